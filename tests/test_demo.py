"""The README's main command: ``python -m coda demo`` reports agreement and exits 0.

The full command (three sections: rmsnorm, train, kernels) runs once, as a subprocess
(about 30 s on 2 CPU cores); the tests read its output and assert the *values* it
prints. Smaller in-process runs check that the checks can fail and the fallbacks."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

import coda.demo
import coda.demo_llama
import coda.nn.loss
from coda.__main__ import main
from coda.demo import run_demo
from coda.demo_llama import GRAD_TOL, KERNELS, LOSS_REL_BOUND, run_kernels, run_training


@pytest.fixture(scope="module")
def full_run() -> str:
    run = subprocess.run(
        [sys.executable, "-m", "coda", "demo"], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def _section(out: str, name: str) -> str:
    """The lines of one section (between its '== [i/n] name ==' header and the next)."""
    m = re.search(rf"^== \[\d/\d\] {name} ==\n(.*?)(?=^== |\Z)", out, re.M | re.S)
    assert m, f"section {name} missing"
    return m.group(1)


def test_cli_passes_every_section(full_run):
    lines = full_run.splitlines()
    assert lines[-1].startswith("PASS: every check passed (rmsnorm ok, train ok, kernels ok)"), (
        lines[-1]
    )
    assert [ln for ln in lines if ln.startswith("== [")] == [
        "== [1/3] rmsnorm ==",
        "== [2/3] train ==",
        "== [3/3] kernels ==",
    ]
    seconds = int(re.search(r" in (\d+) s$", lines[-1]).group(1))
    assert seconds < 90


def test_demo_rmsnorm_section(full_run):
    out = _section(full_run, "rmsnorm")
    assert "PASS: the tile simulator and the reference agree" in out
    assert "3 x 5 tiles of 128x128 (edge tiles ragged: last 44 rows, last 8 columns)" in out
    assert "[6] TileReduce('rstd' = sumsq of 'x' per row, post=rstd)" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("    ")]
    checked = {r[0]: r for r in rows if r[-1] in ("ok", "FAIL")}
    assert set(checked) == {"x", "h", "rstd", "z", "rstd.partials"}
    assert all(r[-1] == "ok" for r in checked.values())
    # sim vs ref is exact or at float32 rounding level, never more
    assert all(float(r[1]) < 1e-5 for r in checked.values())


STEP = re.compile(
    r"^\s+\[[#.]+\]\s+(\d+)/(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.e+-]+)\s+([\d.]+)$", re.M
)


def test_demo_train_section(full_run):
    out = _section(full_run, "train")
    steps = [m.groups() for m in STEP.finditer(out)]
    assert [int(s[0]) for s in steps] == list(range(1, 11)) and {s[1] for s in steps} == {"10"}
    coda_l, eager_l, diff, f64_l = ([float(s[i]) for s in steps] for i in (2, 3, 4, 5))
    # the printed diff column is |coda - eager| / eager, within the stated bound
    assert max(diff) <= LOSS_REL_BOUND
    for c, e, d in zip(coda_l, eager_l, diff, strict=True):
        assert abs(c - e) / e <= d + 1e-6  # printed losses are rounded to 1e-6
    assert all(abs(c - t) / t <= 1e-4 for c, t in zip(coda_l, f64_l, strict=True))
    assert coda_l[-1] < coda_l[0] - 1.0  # it learns the bigram chain
    checks = [
        ln.split(maxsplit=1) for ln in out.splitlines() if ln.startswith("    ok") or "FAIL" in ln
    ]
    assert len(checks) == 5 and all(c[0] == "ok" for c in checks), checks
    grad = re.search(r"gradients vs float64 .*: coda ([\d.e+-]+) <=", out)
    assert float(grad.group(1)) <= GRAD_TOL
    assert "stack 10/10, loss 10/10, fallbacks 0, logits never materialized" in out
    assert out.splitlines()[-2] == "PASS: coda trains the model like eager PyTorch"


def test_demo_kernels_section(full_run):
    out = _section(full_run, "kernels")
    headers = re.findall(r"^  \[(\d)/(\d)\] (\S+) \((fwd|bwd)\)", out, re.M)
    assert [h[2] for h in headers] == list(KERNELS)
    sass = re.findall(r"^      (SASS|PTX): (.*)  (ok|FAIL)$", out, re.M)
    assert len(sass) == len(KERNELS) and all(s[2] == "ok" for s in sass)
    for (kind, text, _), name in zip(sass, KERNELS, strict=True):
        # a map pass never reads acc: its kernel runs no mainloop, so no HGMMA / wgmma
        gemm = not next(c for c in coda.demo_llama._cases() if c.name == name).map_pass
        if kind == "SASS":
            assert bool(re.search(r"HGMMA\.\d+x\d+x16\.\S+ x\d+", text)) == gemm
            assert int(re.search(r"UTMALDG (\d+)", text).group(1)) > 0
            assert int(re.search(r"UTMASTG (\d+)", text).group(1)) > 0
            assert "spills: LDL 0, STL 0" in text
        else:
            assert "ld/st.local 0/0" in text and ("wgmma.mma_async m64n" in text) == gemm
    assert len(re.findall(r"local memory 0 B/thread", out)) == len(KERNELS)
    # the forward GEMMs with real K run the 128-wide tile on 64x128 wgmma
    assert "HGMMA.64x128x16.F32.BF16" in out or "m64n128k16" in out
    assert f"PASS: {len(KERNELS)} kernels, HGMMA (GEMMs) + TMA, no spills" in out


def test_kernels_without_nvdisasm(monkeypatch):
    """Without nvdisasm the section says so and reads the facts from PTX and the ELF."""
    import coda.runtime.sass

    monkeypatch.setattr(coda.runtime.sass, "find_nvdisasm", lambda: None)
    lines: list[str] = []
    report = run_kernels(names=("residual_norm",), emit=lines.append)
    assert report.passed, "\n".join(lines)
    assert any(line.startswith("  nvdisasm not found") for line in lines)
    ptx = [line for line in lines if line.startswith("      PTX: ")]
    assert len(ptx) == 1 and ptx[0].endswith("ok")
    assert "wgmma.mma_async m64n128k16 x" in ptx[0] and "ld/st.local 0/0" in ptx[0]
    assert re.search(r"TMA: loads [1-9]\d* \(\d+ multicast\), stores [1-9]", ptx[0])


def test_training_detects_a_wrong_loss(monkeypatch):
    """The training checks are real: coda's loss 0.01% off fails them."""
    real = coda.nn.loss.linear_cross_entropy

    def off(*args, **kwargs):
        return real(*args, **kwargs) * 1.001

    monkeypatch.setattr(coda.nn.loss, "linear_cross_entropy", off)
    lines: list[str] = []
    report = run_training(steps=2, emit=lines.append)
    assert not report.passed and lines[-1].startswith("FAIL")
    failed = [line for line in lines if line.startswith("    FAIL")]
    assert any("loss coda vs eager" in line for line in failed)
    assert any("gradients vs float64" in line for line in failed)


def test_gpu_note(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert coda.demo_llama.gpu_note() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0))
    assert coda.demo_llama.hopper()
    note = coda.demo_llama.gpu_note()
    assert "runs the GPU training comparison (coda vs eager, bf16" in note
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (8, 0))
    assert not coda.demo_llama.hopper()
    assert "not Hopper" in coda.demo_llama.gpu_note()


def test_gpu_training_report_on_a_cpu_setup():
    """The GPU path's run and report (run_gpu_training), on a tiny CPU fp32 setup: the
    loss table, tokens/s, the agreement rule and the checks."""
    from coda import llama_training as lt

    setup = lt.TrainSetup(
        size=lt.PRESETS["tiny"],
        seq=32,
        batch=2,
        steps=4,
        lr=3e-3,
        dtype=torch.float32,
        reference_dtype=None,
        device="cpu",
    )
    lines: list[str] = []
    report = coda.demo_llama.run_gpu_training(setup=setup, emit=lines.append, show_progress=False)
    assert report.passed, "\n".join(lines)
    text = "\n".join(lines)
    assert "trains on coda and in eager PyTorch (cpu, float32)" in text
    assert re.search(
        r"^\s+coda: +[\d,]+ tokens/s \(median step [\d.]+ ms\), peak memory n/a", text, re.M
    )
    assert "ok   loss curves agree: max |MA4(coda) - MA4(eager)|" in text
    assert "ok   every coda step fused: stack 4/4, loss 4/4, fallbacks 0" in text
    table = re.findall(r"^ +(\d+) +([\d.]+) +([\d.]+) +(\S+) +(\S+)$", text, re.M)
    assert [int(r[0]) for r in table] == [1, 2, 3, 4]
    assert all(abs(float(r[1]) - float(r[2])) < 1e-4 for r in table)
    assert lines[-1] == "PASS: coda trains the model like eager PyTorch"


def test_cli_device_gpu_without_hopper_exits_2(capsys, monkeypatch):
    monkeypatch.setattr(coda.demo_llama, "hopper", lambda: False)
    assert main(["demo", "--device", "gpu", "--parts", "train"]) == 2
    assert "no Hopper (sm_90) GPU" in capsys.readouterr().err


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


def test_cli_rmsnorm_only_with_arguments():
    args = ["--m", "33", "--n", "40", "--k", "24", "--tile", "16x16", "--subtile", "8x8"]
    run = subprocess.run(
        [sys.executable, "-m", "coda", "demo", *args, "--seed", "3", "--parts", "rmsnorm"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "== [1/1] rmsnorm ==" in run.stdout
    assert run.stdout.splitlines()[-1].startswith("PASS: every check passed (rmsnorm ok)")


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--tile", "big"])
    assert exc.value.code == 2
    assert "expected ROWSxCOLS like 128x128, got 'big'" in capsys.readouterr().err
    for bad in (["--parts", "train,gpu"], ["--steps", "0"]):
        with pytest.raises(SystemExit) as exc:
            main(["demo", *bad])
        assert exc.value.code == 2
    with pytest.raises(SystemExit):
        main([])


@pytest.mark.parametrize(
    "args,message",
    [
        (["--tile", "0x3"], "both sizes must be >= 1"),
        (["--m", "0"], "expected a positive integer"),
        (["--subtile", "64by32"], "expected ROWSxCOLS"),
    ],
)
def test_demo_refuses_impossible_sizes_as_usage_errors(args, message, capsys):
    """Bad sizes end in argparse's usage error (exit status 2), not a traceback."""
    with pytest.raises(SystemExit) as e:
        main(["demo", *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
