"""The README's main command: ``python -m coda demo`` reports agreement and exits 0."""

from __future__ import annotations

import subprocess
import sys

import pytest

import coda.demo
from coda.__main__ import main
from coda.demo import run_demo


def test_demo_passes_and_reports(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "PASS: the tile simulator and the reference agree" in out
    assert "3 x 5 tiles of 128x128 (edge tiles ragged: last 44 rows, last 8 columns)" in out
    assert "[6] TileReduce('rstd' = sumsq of 'x' per row, post=rstd)" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("    ")]
    checked = {r[0]: r for r in rows if r[-1] in ("ok", "FAIL")}
    assert set(checked) == {"x", "h", "rstd", "z", "rstd.partials"}
    assert all(r[-1] == "ok" for r in checked.values())
    # sim vs ref is exact or at float32 rounding level, never more
    assert all(float(r[1]) < 1e-5 for r in checked.values())


def test_demo_detects_a_wrong_epilogue(monkeypatch):
    """The demo's checks are real: a subtly wrong GEMM2 epilogue (1% off) fails."""
    from coda import Elementwise, Epilogue, TileStore, VecLoad

    def wrong():
        return Epilogue().add(
            VecLoad("rstd", per="row", dtype=coda.demo.F32),
            Elementwise("z", lambda a, r: a * r * 1.01, ins=("acc", "rstd")),
            TileStore("z", coda.demo.F32),
        )

    monkeypatch.setattr(coda.demo, "gemm2_epilogue", wrong)
    lines = []
    report = run_demo(M=40, N=48, K=32, N2=24, tile=(16, 16), subtile=(8, 8), emit=lines.append)
    assert not report.passed and lines[-1].startswith("FAIL")
    assert any(line.split()[:1] == ["z"] and line.endswith("FAIL") for line in lines)


@pytest.mark.parametrize(
    "args",
    [
        [],
        [
            "--m",
            "33",
            "--n",
            "40",
            "--k",
            "24",
            "--tile",
            "16x16",
            "--subtile",
            "8x8",
            "--seed",
            "3",
        ],
    ],
)
def test_cli_subprocess(args):
    run = subprocess.run(
        [sys.executable, "-m", "coda", "demo", *args], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines()[-1].startswith("PASS")


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--tile", "big"])
    assert exc.value.code == 2
    assert "expected ROWSxCOLS like 128x128, got 'big'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([])
