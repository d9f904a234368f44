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
