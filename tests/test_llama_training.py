"""coda.llama_training and the scripts built on it, on CPU (coda's reference path).

The training-side-by-side logic the GPU demo and ``benchmarks/train_loss.py`` share: the
generated corpus, the moving averages and the agreement rule (which must be able to
fail), a tiny fp32 run where coda and eager agree to fp32 rounding; then the two
benchmark scripts' CPU smoke modes (``train_loss.py --device cpu``, ``train_step.py
--device cpu --tiny``), run as a user runs them, with the JSON fields the issue names.
Skipped without ``transformers`` (coda's test extra)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import coda.nn.loss  # noqa: E402
from coda import llama_training as lt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def tiny(steps: int, **kw) -> lt.TrainSetup:
    opts = dict(
        size=lt.PRESETS["tiny"],
        seq=32,
        batch=2,
        steps=steps,
        lr=3e-3,
        dtype=torch.float32,
        reference_dtype=None,
        device="cpu",
    )
    return lt.TrainSetup(**{**opts, **kw})


def test_markov_tokens_are_seeded_and_follow_the_chain():
    a = lt.markov_tokens(97, 8, 200, seed=3)
    assert torch.equal(a, lt.markov_tokens(97, 8, 200, seed=3))
    assert not torch.equal(a, lt.markov_tokens(97, 8, 200, seed=4))
    assert a.dtype == torch.long and a.shape == (8, 200) and 0 <= a.min() and a.max() < 97
    # the most frequent successor of each token is its chain successor ~90% of the time
    prev, nxt = a[:, :-1].reshape(-1), a[:, 1:].reshape(-1)
    counts = torch.zeros(97, 97).index_put_((prev, nxt), torch.ones(prev.numel()), accumulate=True)
    follow = counts.max(dim=1).values.sum() / counts.sum()
    assert 0.85 < float(follow) < 0.95


def test_moving_average():
    assert lt.moving_average([1.0, 3.0, 5.0, 7.0], window=2) == [1.0, 2.0, 4.0, 6.0]
    assert lt.moving_average([2.0, 4.0], window=20) == [2.0, 3.0]


def test_tiny_run_agrees_is_fused_and_serializes():
    result = lt.train_side_by_side(tiny(4, reference_dtype=torch.float64), show_progress=False)
    assert result.passed, result.notes
    assert result.coda_calls == {"fused_stack": 4, "fused_loss": 4} and not result.coda_fallbacks
    for c, e, r in zip(*(result.losses[k] for k in ("coda", "eager", "reference")), strict=True):
        assert abs(c - e) <= 1e-4 * e and abs(c - r) <= 1e-4 * r  # fp32 rounding only
    agr = result.agreement
    assert agr["window"] == 4 and agr["bound_nats"] == lt.AGREEMENT_BOUND
    assert agr["vs_reference"]["ok"]
    assert set(result.peak_gib) == {"coda", "eager", "reference"}
    assert all(v is None for v in result.peak_gib.values())  # CPU: no CUDA memory stats
    payload = json.loads(json.dumps(result.to_json()))
    assert payload["setup"]["dtype"] == "float32" and payload["setup"]["tokens_per_step"] == 64


def test_agreement_rule_fails_when_coda_computes_another_loss(monkeypatch):
    real = coda.nn.loss.linear_cross_entropy

    def off(*args, **kwargs):
        return real(*args, **kwargs) * 1.05  # ~0.27 nats at ln(256)

    monkeypatch.setattr(coda.nn.loss, "linear_cross_entropy", off)
    result = lt.train_side_by_side(tiny(2), show_progress=False)
    assert result.agreement["max_abs_ma_diff"] > lt.AGREEMENT_BOUND
    assert not result.agreement["ok"] and not result.passed


def run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_train_loss_script_cpu_smoke(tmp_path):
    out = tmp_path / "train_loss_cpu.json"
    r = run(
        "benchmarks/train_loss.py",
        "--device",
        "cpu",
        "--steps",
        "3",
        "--no-progress",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1] == "PASS"
    data = json.loads(out.read_text())
    assert {"device", "versions", "command"} <= set(data)
    assert data["setup"]["dtype"] == "float32" and data["setup"]["reference_dtype"] == "float64"
    assert [len(data["losses"][k]) for k in ("coda", "eager", "reference")] == [3, 3, 3]
    agr = data["agreement"]
    assert agr["ok"] and agr["max_abs_diff"] < 1e-3 and "final_loss" in agr
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_train_step_script_cpu_smoke(tmp_path):
    """The harness end to end on toy sizes: rows with exactly the issue's fields, the
    block rows, a missing Liger recorded as an error (null numbers), merge."""
    out = tmp_path / "train_step.json"
    common = ["--device", "cpu", "--tiny", "--quick", "--seq", "16", "--out", str(out)]
    r = run(
        "benchmarks/train_step.py",
        *common,
        "--methods",
        "coda,eager,liger",
        "--configs",
        "llama3-1b",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert list(row) == [
        "config",
        "H",
        "layers",
        "seq",
        "coda_tokens_per_s",
        "eager_tokens_per_s",
        "compile_tokens_per_s",
        "liger_tokens_per_s",
        "coda_peak_gib",
        "eager_peak_gib",
        "compile_peak_gib",
        "liger_peak_gib",
    ]
    assert row["config"] == "llama3-1b" and row["seq"] == 16
    assert row["coda_tokens_per_s"] > 0 and row["eager_tokens_per_s"] > 0
    assert row["compile_tokens_per_s"] is None  # not run
    (details,) = data["details"]
    assert details["coda_calls"]["fused_stack"] == details["coda_calls"]["fused_loss"] > 0
    assert not details["coda_fallbacks"]
    # the issue profile is a GPU measurement: recorded per method, null on the CPU
    assert details["syncs_per_step"] == details["gpu_ops_per_step"]
    assert details["syncs_per_step"]["coda"] is None and "liger" in details["syncs_per_step"]
    first = details["first_loss"]
    assert abs(first["coda"] - first["eager"]) < 1e-3 * first["eager"]
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        assert row["liger_tokens_per_s"] is None and "liger" in details["errors"]
    assert [(b["H"], b["pass"]) for b in data["block"]] == [(64, "fwd"), (64, "fwd+bwd")]
    for b in data["block"]:
        assert set(b) == {
            "H",
            "M",
            "pass",
            "coda_ms",
            "compile_ms",
            "cublas_floor_ms",
            "coda_floor_ms",
        }
        assert b["M"] == 16 and b["coda_ms"] > 0 and b["cublas_floor_ms"] > 0
    # a second config merged into the same file, no block
    r = run(
        "benchmarks/train_step.py",
        *common,
        "--methods",
        "coda",
        "--configs",
        "h4096-trunc",
        "--no-block",
        "--merge",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    assert [row["config"] for row in data["rows"]] == ["llama3-1b", "h4096-trunc"]
    assert len(data["block"]) == 2 and len(data["commands"]) == 2
    # --combine: files from separate runs merged into one (no model runs)
    both = tmp_path / "combined.json"
    r = run("benchmarks/train_step.py", "--combine", str(out), str(out), "--out", str(both))
    assert r.returncode == 0, r.stdout + r.stderr
    again = json.loads(both.read_text())
    assert again["rows"] == data["rows"] and again["block"] == data["block"]


def test_train_step_script_without_cuda_says_so():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    r = run("benchmarks/train_step.py", "--quick")
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr


def test_compiled_model_gets_the_causal_mask_eager_mode_makes(monkeypatch):
    """train_step.py's torch.compile contender: Hugging Face's create_causal_mask swapped,
    around its steps only, for one returning eager mode's None (SDPA is_causal=True) on
    these unpadded batches, so its flash attention skips the masked half as eager's
    does; a padding mask is refused rather than ignored; --compile-hf-mask keeps
    transformers' function."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import train_step as ts
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from transformers.models.llama import modeling_llama

    assert ts.causal_mask_as_eager(config=None, inputs_embeds=None, attention_mask=None) is None
    with pytest.raises(ValueError, match="padding"):
        ts.causal_mask_as_eager(attention_mask=torch.ones(1, 4, dtype=torch.bool))
    monkeypatch.setattr(ts, "DEVICE", "cpu")
    monkeypatch.setattr(ts, "DTYPE", torch.float32)
    size = ts.configs(2, tiny=True)["llama3-1b"]
    ids = torch.randint(0, size.vocab, (1, 8))
    hf = modeling_llama.create_causal_mask
    method = ts.Method("compile", lt.build_model(size, torch.float32, "cpu", seed=0), ids)
    assert method.globals == {"create_causal_mask": ts.causal_mask_as_eager}
    with ts.swapped(method.globals):
        assert modeling_llama.create_causal_mask is ts.causal_mask_as_eager
    assert modeling_llama.create_causal_mask is hf
    monkeypatch.setattr(ts, "COMPILE_HF_MASK", True)
    kept = ts.Method("compile", lt.build_model(size, torch.float32, "cpu", seed=0), ids)
    assert kept.globals == {}
