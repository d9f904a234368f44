"""Training-loss agreement: a Hugging Face Llama trained with coda and in eager PyTorch.

    python benchmarks/train_loss.py [--steps 200] [--out benchmarks/results/train_loss_h200.json]
    python benchmarks/train_loss.py --device cpu --steps 5        # CPU smoke run (tiny, fp32)

Sits in benchmarks/ (not installed); the training logic is ``coda.llama_training`` (shared
with the GPU path of ``python -m coda demo``). One ``transformers`` LlamaForCausalLM from
a small random config (default on CUDA: H=512, 4 layers, 8 query / 4 KV heads, FFN 1536,
vocab 32000, seq 1024, batch 4; on CPU: the "tiny" preset) is initialized once and
deep-copied before patching; ``coda`` (``apply_coda``, strict) and ``eager`` (unpatched)
train ``--steps`` AdamW steps in ``--dtype`` (bf16 on CUDA, fp32 on CPU, where coda runs
its reference path) on the same locally generated batches (a noisy Markov chain, fixed
seed), alternating step by step; a third copy, ``reference``, trains in fp32 (float64
on CPU) unless ``--no-reference``.

Agreement rule (stated in ``coda.llama_training``): max |MA20(coda) - MA20(eager)| <= 0.05
nats over the run (MA20: trailing 20-step mean of the per-step losses). Recorded: both
curves (and the reference's), max and mean |coda - eager| per step, the moving-average
difference, final losses, tokens/s (median step time after 10 steps), peak memory per
method. Writes the JSON (device, versions, command, result) and a PNG (the curves and
their difference). Exit status 1 when the rule fails or coda fell back to eager.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Any

import torch

from coda import llama_training as lt

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def environment(device: str) -> dict[str, Any]:
    """Device, versions and command (benchmarks/common.py's fields; CPU-safe)."""
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("transformers", "nvidia-cutlass-dsl"):
        try:
            from importlib.metadata import version

            versions[dist] = version(dist)
        except Exception:
            versions[dist] = None
    if device == "cuda":
        versions["cuda"] = torch.version.cuda
        name = torch.cuda.get_device_name(0)
    else:
        name = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return {
        "device": name,
        "versions": versions,
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if any")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument(
        "--preset",
        choices=sorted(lt.PRESETS),
        default=None,
        help="model sizes; default small on CUDA, tiny on CPU",
    )
    for name in ("hidden", "layers", "heads", "kv-heads", "ffn", "vocab"):
        p.add_argument(f"--{name}", type=int, default=None, help="override the preset")
    p.add_argument("--seq", type=int, default=None, help="default 1024 (CUDA), 64 (CPU)")
    p.add_argument("--batch", type=int, default=None, help="default 4 (CUDA), 2 (CPU)")
    p.add_argument("--lr", type=float, default=None, help="default 1e-3 (CUDA), 3e-3 (CPU)")
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="coda and eager; default bf16 (CUDA), fp32 (CPU)",
    )
    p.add_argument("--no-reference", action="store_true", help="skip the fp32/float64 run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="50 steps (a short check)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--out",
        default=None,
        help="JSON path; default benchmarks/results/train_loss_h200.json "
        "(train_loss_cpu.json on CPU)",
    )
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    if args.quick:
        args.steps = min(args.steps, 50)
    return args


def setup_from(args: argparse.Namespace) -> lt.TrainSetup:
    cpu = args.device == "cpu"
    base = lt.PRESETS[args.preset or ("tiny" if cpu else "small")]
    size = lt.LlamaSize(
        vocab=args.vocab or base.vocab,
        hidden=args.hidden or base.hidden,
        intermediate=args.ffn or base.intermediate,
        layers=args.layers or base.layers,
        heads=args.heads or base.heads,
        kv_heads=args.kv_heads or base.kv_heads,
    )
    dtype = DTYPES[args.dtype or ("fp32" if cpu else "bf16")]
    higher = torch.float64 if dtype == torch.float32 else torch.float32
    ref = None if args.no_reference else higher
    return lt.TrainSetup(
        size=size,
        seq=args.seq or (64 if cpu else 1024),
        batch=args.batch or (2 if cpu else 4),
        steps=args.steps,
        lr=args.lr or (3e-3 if cpu else 1e-3),
        dtype=dtype,
        reference_dtype=ref,
        device=args.device,
        seed=args.seed,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    setup = setup_from(args)
    out = args.out or (
        "benchmarks/results/train_loss_h200.json"
        if args.device == "cuda"
        else "benchmarks/results/train_loss_cpu.json"
    )
    result = lt.train_side_by_side(setup, show_progress=not args.no_progress)
    env = environment(args.device)
    payload = {**env, **result.to_json()}
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
    png = os.path.splitext(out)[0] + ".png"
    s = setup.size
    title = (
        f"HF LlamaForCausalLM H={s.hidden}, {s.layers} layers, {s.heads}/{s.kv_heads} heads, "
        f"FFN {s.intermediate}, vocab {s.vocab}\n{setup.batch}x{setup.seq} tokens/step, "
        f"{str(setup.dtype).removeprefix('torch.')}, AdamW, {setup.steps} steps, {env['device']}"
    )
    drawn = lt.plot_losses(result, png, title)
    agr = result.agreement
    print(f"wrote {out}" + (f" and {png}" if drawn else " (matplotlib not installed: no PNG)"))
    print(f"  rule: {agr['rule']}")
    print(
        f"  max |MA diff| {agr['max_abs_ma_diff']:.4f} nats ({'ok' if agr['ok'] else 'FAIL'}); "
        f"per step: max |diff| {agr['max_abs_diff']:.4f}, mean |diff| {agr['mean_abs_diff']:.4f}"
    )
    if "vs_reference" in agr:
        v = agr["vs_reference"]
        print(
            f"  vs reference: coda {v['coda_err']:.4f}, eager {v['eager_err']:.4f} "
            f"({'ok' if v['ok'] else 'over'}: {v['rule']})"
        )
    finals = ", ".join(f"{k} {v:.4f}" for k, v in agr["final_loss"].items())
    print(f"  final loss: {finals}; learned: {result.learned}")
    for k in result.losses:
        peak = result.peak_gib[k]
        print(
            f"  {k:>9}: {result.tokens_per_s[k]:>12,.0f} tokens/s, median step "
            f"{result.median_step_ms[k]:.2f} ms, peak "
            + ("n/a" if peak is None else f"{peak:.3f} GiB")
        )
    for note in result.notes:
        print(f"  note: {note}")
    print("PASS" if result.passed else "FAIL")
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
