"""``coda.testing.sass_snapshot``: the SASS of a kernel written twice compares SAME, and a
changed or missing file is reported (CPU: compiles for sm_90a, disassembles with nvdisasm)."""

from __future__ import annotations

import os

import pytest

from coda.runtime.sass import find_nvdisasm
from coda.testing import sass_snapshot

pytestmark = pytest.mark.compile


def test_write_twice_is_the_same_and_changes_are_reported(tmp_path, monkeypatch):
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed")
    monkeypatch.setenv("CODA_DISK_CACHE", "1")
    before, after = tmp_path / "before", tmp_path / "after"
    written = sass_snapshot.write(str(before), ["plain_fwd"])
    sass_snapshot.write(str(after), ["plain_fwd"])
    text = (before / "plain_fwd.sass").read_text()
    assert "HGMMA" in text and list(written) == ["plain_fwd"]
    assert os.environ["CODA_DISK_CACHE"] == "1"  # off only while it compiled
    assert sass_snapshot.compare(str(before), str(after)) == {"plain_fwd": "SAME"}
    assert sass_snapshot.main(["compare", str(before), str(after)]) == 0

    (after / "plain_fwd.sass").write_text(text.replace("HGMMA", "HMMA", 1))
    (before / "extra.sass").write_text(text)
    verdict = sass_snapshot.compare(str(before), str(after))
    assert verdict == {"extra": "MISSING", "plain_fwd": "DIFF"}
    assert sass_snapshot.main(["compare", str(before), str(after)]) == 1


def test_unknown_kernel_names_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown kernels"):
        sass_snapshot.write(str(tmp_path), ["no_such_kernel"])


_FAKE = """
        /*0010*/                   FFMA R1, R2, R3, R4 ;                     /* 0x0 */
        /*0020*/                   FADD R5, RZ, R6 ;                         /* 0x0 */
        /*0030*/                   FADD.FTZ R5, R5, -RZ ;                    /* 0x0 */
        /*0040*/                   FADD R7, R5, R6 ;                         /* 0x0 */
        /*0050*/              @!P0 FMUL R8, R7, 2 ;                          /* 0x0 */
        /*0060*/                   MUFU.EX2 R9, R8 ;                         /* 0x0 */
        /*0070*/                   SHFL.BFLY PT, R10, R9, 0x1, 0x1f ;        /* 0x0 */
        /*0080*/                   STL [R1], R10 ;                           /* 0x0 */
"""


def test_counts_profile_every_kernel_and_compare_folders(tmp_path, capsys):
    """``counts`` needs no compiler: it reads the ``.sass`` files ``write`` left."""
    before, after = tmp_path / "before", tmp_path / "after"
    before.mkdir()
    after.mkdir()
    (before / "k.sass").write_text(_FAKE)
    (after / "k.sass").write_text(_FAKE.replace("FADD R5, RZ, R6", "MOV R5, R6"))
    profile = sass_snapshot.counts(str(before))["k"]
    assert profile == {
        "instructions": 8,
        "fp32": 5,
        "mufu": 1,
        "shfl": 1,
        "imad": 0,
        "spills": 1,
        "adds_of_zero": 2,
    }
    assert sass_snapshot.counts(str(after))["k"]["adds_of_zero"] == 1
    assert sass_snapshot.main(["counts", str(before), str(after)]) == 0
    out = capsys.readouterr().out
    assert "adds_of_zero" in out and "5 -> 4" in out
