"""``python -m coda bench`` on CPU: its help, the clean failure without a CUDA GPU, and the
family runner (coda.bench.run_families) on stand-in scripts written here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from coda import bench
from coda.__main__ import main

ROOT = Path(__file__).resolve().parents[1]


def test_bench_help():
    r = subprocess.run(
        [sys.executable, "-m", "coda", "bench", "--help"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())
    assert "usage: coda bench" in out and "--only NAME[,NAME]" in out and "--quick" in out
    assert "not part of the installed package" in out
    for family in bench.FAMILIES:
        assert f"{family.name}:" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_bench_without_cuda_fails_cleanly():
    r = subprocess.run(
        [sys.executable, "-m", "coda", "bench", "--only", "train_step", "--quick"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.startswith("coda bench: no CUDA GPU (torch.cuda.is_available() is False)")


def test_bench_rejects_unknown_families(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--only", "gemm,nope"])
    assert exc.value.code == 2
    assert "expected a comma-separated subset of gemm, " in capsys.readouterr().err


def test_bench_list_finds_the_repository_scripts(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    assert f"benchmarks folder: {ROOT / 'benchmarks'}" in out
    for name in ("gemm", "patterns", "train_step", "train_loss"):
        assert any(line.split()[:2] == [name, "found"] for line in out.splitlines())
    assert bench.find_benchmarks() == ROOT / "benchmarks"


def test_device_tag():
    assert bench.device_tag("NVIDIA H200") == "h200"
    assert bench.device_tag("NVIDIA H100 80GB HBM3") == "h100"
    assert bench.device_tag("Some GPU") == "gpu"


STAND_IN = """
import argparse, json
p = argparse.ArgumentParser()
p.add_argument("--out")
p.add_argument("--rounds", type=int, default=7)
p.add_argument("--calls", type=int, default=200)
a = p.parse_args()
print("rounds", a.rounds)
json.dump({"device": "stand-in", "rows": [{"kind": "gemm", "name": "gemm", "shape": [8, 8, 8],
           "coda_us": 7.0, "eager_us": 10.0}]}, open(a.out, "w"))
"""


def test_run_families_writes_json_logs_and_reports_failures(tmp_path):
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    (folder / "common.py").write_text("")
    (folder / "launch_overhead.py").write_text(STAND_IN)
    (folder / "gemm.py").write_text("import sys; print('boom'); sys.exit(3)\n")
    out = tmp_path / "results"
    lines: list[str] = []
    res = bench.run_families(
        ["launch_overhead", "gemm"], out, folder, "h200", quick=True, emit=lines.append
    )
    assert res["launch_overhead"]["returncode"] == 0 and res["gemm"]["returncode"] == 3
    data = json.loads((out / "launch_overhead_h200.json").read_text())
    assert data["rows"][0]["coda_us"] == 7.0
    log = (out / "logs" / "launch_overhead.log").read_text()
    assert "--out" in log and "--rounds 3 --calls 100" in log and "rounds 3" in log
    assert lines[0].startswith("launch_overhead: ok in ")
    assert lines[1].startswith("gemm: FAILED (exit 3)") and "boom" in lines[2]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "launch_overhead_h200.png").is_file()  # drawn by coda.bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_gpu_fuzzer_without_cuda_fails_cleanly(tmp_path):
    # the README's fuzz command on a CPU machine: a clear message before anything is
    # drawn or written (it was a hypothesis traceback ending in torch's CUDA assertion)
    out = tmp_path / "fuzz.json"
    r = subprocess.run(
        [sys.executable, "-m", "coda.testing.fuzz", "--examples", "3", "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.startswith("python -m coda.testing.fuzz: no CUDA GPU")
    assert "test_simulator_properties.py" in r.stderr
    assert not out.exists()
