"""Where a fused pass's GPU time goes, kernel by kernel (torch.profiler).

    python benchmarks/kernel_profile.py [--H 2048] [--M 8192] [--V 128256] [--reps 5]
        [--out benchmarks/results/kernel_profile_h200.json]

Profiles, after warm-up, ``--reps`` passes of each of:

* ``block_coda``: one fused Llama decoder layer (``coda.nn.FusedLlamaDecoderLayer``),
  forward + backward, the ``train_step.py`` block;
* ``block_floor``: its GEMMs (cuBLAS) + SDPA alone, forward + backward;
* ``block_compile``: the HF layer under ``torch.compile``, forward + backward;
* ``ce_coda`` / ``ce_compile``: the LM-head cross-entropy (``linear_cross_entropy`` vs
  torch.compile of the eager loss), forward + backward, M x H hidden, V x H weight.

Per contender it writes the kernels' summed device time per pass, grouped by kernel
name (top 25), the pass's wall time, the GPU-busy fraction (busy < wall means the
host or a sync left the GPU idle), the profiled pass's kernel span and the idle time
inside it (no kernel running: the GPU waiting for launches, a sync or an allocation),
and the CUDA runtime/driver calls that took the most host time. JSON ``{"device",
"versions", "command", "profiles": {name: {"wall_ms", "gpu_ms", "span_ms", "idle_ms",
"runtime_api": [{"name", "ms", "calls"}], "categories_ms", "kernels": [{"name", "ms",
"calls"}], "sequence_one_pass": [[name, us, grid, registers, idle us before it]],
"largest_gaps": [[us, kernel before, kernel after, its index over the profiled passes]]}}}``
and a PNG beside it (GPU time by kernel family per profile; ``--replot FILE`` redraws
it from a written JSON, on any machine).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import train_step as ts  # noqa: E402

GiB = 2**30


def category(name: str) -> str:
    n = name.lower()
    if "codamainloop" in n:
        return "coda_gemm"
    if "finalize" in n and "coda" in n:
        return "coda_finalize"
    if any(s in n for s in ("nvjet", "gemm", "xmma", "cutlass")):
        return "cublas"
    if any(s in n for s in ("sdpa", "fmha", "flash", "cudnn")):
        return "attention"
    if "adam" in n or "fusedoptimizer" in n:
        return "optimizer"
    if "at::native" in n or "memset" in n or "memcpy" in n:
        return "torch_elementwise"
    return "other (triton, ...)"


def _annotation(ev) -> bool:
    """A user annotation (record_function), not a kernel: kernel names may hold '#' too
    ('{lambda()#1}'), so the optimizer's annotation is recognized by its prefix."""
    return bool(getattr(ev, "is_user_annotation", False)) or ev.name.startswith(
        ("Optimizer.", "ProfilerStep#")
    )


def _span_and_idle(kern: list, reps: int) -> tuple[float, float]:
    """Per pass (ms): the span from the first kernel's start to the last one's end, and
    the time in it when no kernel ran (the GPU waiting for the host: launches, syncs,
    allocations). Kernels (sorted by start) may overlap; gaps are where none runs."""
    if not kern:
        return 0.0, 0.0
    first = kern[0]["ts"]
    end = first
    idle = 0.0
    for e in kern:
        if e["ts"] > end:
            idle += e["ts"] - end
        end = max(end, e["ts"] + e["dur"])
    return (end - first) / 1e3 / reps, idle / 1e3 / reps


def _largest_gaps(kern: list, top: int = 12) -> list[list]:
    """The ``top`` longest stretches with no kernel running (kernels sorted by start):
    ``[gap us, the kernel before it, the kernel after it, the latter's index]``."""
    gaps, end, before = [], None, None
    for i, e in enumerate(kern):
        if end is not None and e["ts"] > end:
            gaps.append([round(e["ts"] - end, 1), before[:60], e["name"][:60], i])
        if end is None or e["ts"] + e["dur"] >= end:
            end, before = e["ts"] + e["dur"], e["name"]
    return sorted(gaps, key=lambda g: -g[0])[:top]


def _runtime_api(events: list, reps: int, top: int = 8) -> list[dict]:
    """The CUDA runtime / driver calls that took the most host time per pass (a sync or
    an allocation that stalls the GPU shows here): ``{"name", "ms", "calls"}``."""
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "dur" in e:
            per[e["name"]][0] += e["dur"] / 1e3 / reps
            per[e["name"]][1] += 1 / reps
    rows = sorted(per.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"name": k, "ms": round(v[0], 4), "calls": round(v[1], 2)} for k, v in rows]


def profile(fn, reps: int, warmup: int = 3) -> dict:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3 / reps
    acts = [torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0.0, 0])
    cats = defaultdict(float)
    for ev in prof.events():
        # kernels, copies and memsets only: a user annotation's device time (e.g.
        # "Optimizer.step#AdamW.step") spans kernels already counted on their own
        if ev.device_type == torch.autograd.DeviceType.CUDA and not _annotation(ev):
            key = ev.name[:160]
            per[key][0] += ev.device_time_total / 1e3 / reps
            per[key][1] += 1
            cats[category(ev.name)] += ev.device_time_total / 1e3 / reps
    seq = []
    path = "/tmp/kernel_profile_trace.json"
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    kern = sorted(
        (e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel"),
        key=lambda e: e["ts"],
    )
    span, idle = _span_and_idle(kern, reps)
    api = _runtime_api(trace.get("traceEvents", []), reps)
    n_one = len(kern) // max(reps, 1)
    prev_end = None
    for e in kern[:n_one]:
        a = e.get("args", {})
        gap = 0.0 if prev_end is None else max(0.0, e["ts"] - prev_end)
        prev_end = e["ts"] + e["dur"] if prev_end is None else max(prev_end, e["ts"] + e["dur"])
        seq.append(
            [e["name"][:48], round(e["dur"], 1), a.get("grid"), a.get("registers per thread"),
             round(gap, 1)]
        )  # fmt: skip
    kernels = sorted(
        ({"name": k, "ms": round(v[0], 4), "calls": v[1] / reps} for k, v in per.items()),
        key=lambda r: -r["ms"],
    )
    gpu = sum(r["ms"] for r in kernels)
    return {
        "wall_ms": round(wall, 3),
        "gpu_ms": round(gpu, 3),
        "span_ms": round(span, 3),
        "idle_ms": round(idle, 3),
        "runtime_api": api,
        "categories_ms": {k: round(v, 3) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        "kernels": kernels[:30],
        "sequence_one_pass": seq if len(seq) <= 400 else seq[:400],
        "largest_gaps": _largest_gaps(kern),
    }


def train_profiles(args, out: dict) -> None:
    """A whole training step (fwd + bwd + AdamW) of ``--train-config`` (default the 1B
    model): coda vs torch.compile, Liger, eager HF, kernel categories, plus memory after
    the forward."""
    from coda.llama_training import build_model

    size = ts.configs(args.layers4096)[args.train_config]
    ids = torch.randint(0, size.vocab, (1, args.M), device="cuda")
    ts.AMP = args.amp  # ts.Method's steps run under autocast with it
    dtype = torch.float32 if args.amp else torch.bfloat16
    for name in args.train:
        gc.collect()
        torch.cuda.empty_cache()
        model = build_model(size, dtype, "cuda", seed=0)
        meth = ts.Method(name, model, ids)
        for _ in range(3):
            meth.step()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with ts.swapped(meth.globals):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=args.amp):
                loss = meth.run(input_ids=ids, labels=ids).loss
            torch.cuda.synchronize()
            after_fwd = torch.cuda.memory_allocated()
            peak_fwd = torch.cuda.max_memory_allocated()
            loss.backward()
        meth.opt.step()
        meth.opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        del loss
        prof = profile(meth.step, 2, warmup=1)
        prof["memory_gib"] = {
            "resident_before_step": round(base / GiB, 3),
            "saved_after_forward": round((after_fwd - base) / GiB, 3),
            "peak_in_forward_above_resident": round((peak_fwd - base) / GiB, 3),
            "peak_in_step_above_resident": round((peak - base) / GiB, 3),
        }
        prof.pop("sequence_one_pass")
        out["profiles"][f"train_{name}"] = prof
        print(f"train_{name}", prof["wall_ms"], prof["gpu_ms"], prof["memory_gib"])
        meth.close()
        del meth, model


def chart(payload: dict, png: str) -> bool:
    """Stacked bars of GPU time by kernel family, one panel for the block and loss
    profiles and one for the training steps; False without matplotlib."""
    plt = common.pyplot()
    if plt is None:
        return False

    profiles = payload["profiles"]
    groups = [
        [n for n in profiles if not n.startswith("train_")],
        [n for n in profiles if n.startswith("train_")],
    ]
    groups = [g for g in groups if g]
    if not groups:
        return False
    cats = sorted({c for p in profiles.values() for c in p["categories_ms"]})
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.5), squeeze=False)
    for ax, names in zip(axes[0], groups, strict=True):
        bottom = [0.0] * len(names)
        for c in cats:
            vals = [profiles[n]["categories_ms"].get(c, 0.0) for n in names]
            ax.bar(range(len(names)), vals, bottom=bottom, label=c)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
        ax.plot(range(len(names)), [profiles[n]["wall_ms"] for n in names], "k_", ms=30,
                label="wall time")  # fmt: skip
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
        ax.set_ylabel("ms per pass (GPU time by kernel family)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"kernel_profile, {payload.get('device', '')}", fontsize=10)
    common.save_figure(plt, fig, png)
    return True


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--H", type=int, default=2048)
    p.add_argument("--M", type=int, default=8192)
    p.add_argument("--V", type=int, default=128256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--only", nargs="*", default=None)
    p.add_argument(
        "--train", nargs="*", default=[], help="whole training steps: coda compile liger eager"
    )
    p.add_argument(
        "--train-config",
        default="llama3-1b",
        choices=("llama3-1b", "h4096-trunc"),
        help="the model of --train (train_step.py's configs)",
    )
    p.add_argument("--layers4096", type=int, default=2, help="layers of h4096-trunc")
    p.add_argument(
        "--amp",
        action="store_true",
        help="--train under AMP: fp32 parameters, forwards under torch.autocast to bf16",
    )
    p.add_argument(
        "--torch-casts",
        action="store_true",
        help="--amp with coda's weight casts on PyTorch's kernels: no gradient widening "
        "(coda.fusions._dispatch.WIDEN_GRADIENTS off) and no gate/up cast pass "
        "(coda.fusions.cast_layouts)",
    )
    p.add_argument("--seq", action="store_true", help="print each pass's kernel sequence")
    p.add_argument("--out", default="benchmarks/results/kernel_profile_h200.json")
    common.add_replot_option(p)
    args = p.parse_args(argv)
    if common.replotted(args, chart):
        return
    if args.torch_casts:
        from coda.fusions import _dispatch, cast_layouts

        _dispatch.WIDEN_GRADIENTS = False
        cast_layouts.MIN_NUMEL = sys.maxsize
    size = ts.configs(4)["llama3-1b" if args.H == 2048 else "h4096-trunc"]
    out = {**common.environment(), "command": " ".join(sys.argv), "profiles": {}}

    def want(name: str) -> bool:
        return args.only is None or name in args.only

    if any(want(n) for n in ("block_coda", "block_floor", "block_compile")):
        block = ts.Block(size, args.M)
        fns = {
            "block_coda": lambda: block.coda(True),
            "block_floor": lambda: block.floor(ts.cublas_mm, True),
            "block_compile": lambda: block.hf(True),
        }
        for name, make in fns.items():
            if want(name):
                out["profiles"][name] = profile(make(), args.reps)
                print(name, out["profiles"][name]["wall_ms"], out["profiles"][name]["gpu_ms"])
        del block
    if any(want(n) for n in ("ce_coda", "ce_compile")):
        from coda.fusions import linear_cross_entropy

        g = torch.Generator(device="cuda").manual_seed(0)
        bf = torch.bfloat16
        h = (torch.randn(args.M, args.H, device="cuda", generator=g) * 0.5).to(bf)
        W = (torch.randn(args.V, args.H, device="cuda", generator=g) * args.H**-0.5).to(bf)
        h.requires_grad_()
        W.requires_grad_()
        t = torch.randint(0, args.V, (args.M,), device="cuda", generator=g)

        def eager(h, W, t):
            return F.cross_entropy((h @ W.T).float(), t, ignore_index=-100)

        comp = torch.compile(eager)
        fns = {
            "ce_coda": lambda: torch.autograd.grad(linear_cross_entropy(h, W, t), (h, W)),
            "ce_compile": lambda: torch.autograd.grad(comp(h, W, t), (h, W)),
        }
        for name, fn in fns.items():
            if want(name):
                out["profiles"][name] = profile(fn, args.reps)
                print(name, out["profiles"][name]["wall_ms"], out["profiles"][name]["gpu_ms"])
    if args.train:
        train_profiles(args, out)
    for name, prof in out["profiles"].items():
        print(
            f"\n== {name}: wall {prof['wall_ms']} ms, GPU {prof['gpu_ms']} ms, span "
            f"{prof.get('span_ms')} ms, idle {prof.get('idle_ms')} ms"
        )
        print("   runtime API:", prof.get("runtime_api"))
        print("  ", prof["categories_ms"])
        for r in prof["kernels"][:18]:
            print(f"  {r['ms']:8.3f} ms  x{r['calls']:<5g} {r['name'][:110]}")
        if args.seq and "sequence_one_pass" in prof:
            for r in prof["sequence_one_pass"]:
                print("     ", r)
    common.write_json(args.out, out)
    chart(out, common.png_beside(args.out))


if __name__ == "__main__":
    main()
