"""coda.__main__: the command line, ``python -m coda <command>`` (also the ``coda`` script).

Commands:
  demo   three sections, each with its own checks; exit status 0 when all pass (PASS), else 1:
         1. rmsnorm: compose the RMSNorm-forward epilogue (DESIGN.md section 5), run the
            reference and the tile simulator on random inputs, print the outputs and their
            agreement with textbook math (coda.demo);
         2. train: on a Hopper GPU, a small transformers Llama trains a few hundred bf16
            AdamW steps with coda and in eager PyTorch side by side (tokens/s, peak memory,
            loss-curve agreement; coda.demo_llama.run_gpu_training); on a CPU machine (or
            with --device cpu) a tiny one trains a few steps on the CPU reference path next
            to eager PyTorch in fp32 and float64 (coda.demo_llama.run_training);
         3. kernels: one decoder layer's fused GEMM kernels compiled for sm_90a, with what
            their SASS contains: HGMMA, TMA, spills (coda.demo_llama).
  bench  the benchmark families of the repository's benchmarks/ folder, one after another,
         with a progress bar, each writing JSON + PNG into --out (coda.bench); needs a CUDA
         GPU (exit status 2 without one).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _pair(text: str) -> tuple[int, int]:
    try:
        a, b = (int(v) for v in text.lower().replace(",", "x").split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ROWSxCOLS like 128x128, got {text!r}") from None
    if a < 1 or b < 1:
        raise argparse.ArgumentTypeError(f"both sizes must be >= 1; got {text!r}")
    return a, b


PARTS = ("rmsnorm", "train", "kernels")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _parts(text: str) -> tuple[str, ...]:
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated subset of {PARTS}, got {text!r}"
        )
    return parts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="coda", description="coda: Transformer epilogues fused into Hopper GEMMs."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="RMSNorm epilogue, a Llama trained on coda vs eager, a layer's sm_90a kernels",
        description="1. rmsnorm: compose the deferred RMSNorm forward (two GEMM epilogues), "
        "run the reference and the CPU tile simulator, and report their agreement. "
        "2. train: on a Hopper GPU, a small transformers Llama trains a few hundred bf16 "
        "steps with coda and in eager PyTorch side by side (tokens/s, peak memory, loss "
        "agreement); on a CPU machine, a tiny one trains on the CPU reference path next to "
        "eager PyTorch (fp32 and float64). 3. kernels: one decoder layer's fused kernels "
        "compiled for sm_90a, and what their SASS contains.",
    )
    demo.add_argument("--m", type=_positive, default=300, help="rows M (tokens), default 300")
    demo.add_argument("--n", type=_positive, default=520, help="hidden size N, default 520")
    demo.add_argument("--k", type=_positive, default=256, help="GEMM1 reduction K, default 256")
    demo.add_argument("--n2", type=_positive, default=384, help="GEMM2 output width, default 384")
    demo.add_argument("--tile", type=_pair, default=(128, 128), help="tile, default 128x128")
    demo.add_argument("--subtile", type=_pair, default=(64, 32), help="subtile, default 64x32")
    demo.add_argument("--seed", type=int, default=0, help="random seed, default 0")
    demo.add_argument(
        "--steps",
        type=_positive,
        default=None,
        help="training steps of section 2; default 10 on the CPU path, 300 on the GPU path",
    )
    demo.add_argument(
        "--device",
        choices=("auto", "cpu", "gpu"),
        default="auto",
        help="section 2's path: gpu (needs a Hopper GPU), cpu (reference path), or auto "
        "(gpu when torch sees an sm_90 GPU), default auto",
    )
    demo.add_argument(
        "--parts",
        type=_parts,
        default=PARTS,
        help=f"comma-separated sections to run, default {','.join(PARTS)}",
    )
    _bench_parser(commands)
    return parser


def _families(text: str) -> tuple[str, ...]:
    from coda.bench import FAMILIES

    known = [f.name for f in FAMILIES]
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated subset of {', '.join(known)}; got {text!r}"
        )
    return names


def _bench_parser(commands: argparse._SubParsersAction) -> None:
    from coda.bench import FAMILIES

    listing = "; ".join(f"{f.name}: {f.what}" for f in FAMILIES)
    bench = commands.add_parser(
        "bench",
        help="run the benchmark families (GPU) with a progress bar, JSON + PNG per family",
        description="Runs the scripts of the repository's benchmarks/ folder one after another "
        "(each in its own process, output in OUT/logs/), with a progress bar, writing "
        "OUT/<family>_<gpu>.json and .png per family (gpu: h200, h100, ...). benchmarks/ is "
        "not part of the installed package: it is found next to the source tree coda was "
        "installed from (a checkout or an editable install), else as ./benchmarks, unless "
        f"--benchmarks or $CODA_BENCHMARKS names it. Families: {listing}. Needs a CUDA GPU "
        "(Hopper for coda's kernels): without one it says so and exits with status 2.",
    )
    bench.add_argument(
        "--only",
        type=_families,
        default=None,
        metavar="NAME[,NAME]",
        help="run only these families (default: every family whose script exists)",
    )
    bench.add_argument("--quick", action="store_true", help="shorter runs (fewer rounds, sizes)")
    bench.add_argument(
        "--out", default="benchmarks/results", help="output folder, default benchmarks/results"
    )
    bench.add_argument(
        "--benchmarks", default=None, metavar="DIR", help="the benchmarks/ folder (see above)"
    )
    bench.add_argument(
        "--list", action="store_true", help="list the families and the scripts found, then exit"
    )


def _bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from coda import bench

    folder = bench.find_benchmarks(args.benchmarks)
    names = args.only or tuple(f.name for f in bench.FAMILIES)
    if args.list:
        where = folder if folder is not None else "not found"
        print(f"benchmarks folder: {where}")
        for f in bench.FAMILIES:
            there = folder is not None and (folder / f"{f.name}.py").is_file()
            print(f"  {f.name:<18} {'found  ' if there else 'missing'}  {f.what}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print(
            "coda bench: no CUDA GPU (torch.cuda.is_available() is False). The benchmark "
            "families time coda's kernels against cuBLAS, torch.compile and Liger-Kernel on "
            "an NVIDIA GPU (Hopper, sm_90, for coda); run this on an H100/H200. On a CPU "
            "machine, smoke runs: python benchmarks/train_loss.py --device cpu --steps 5; "
            "python benchmarks/train_step.py --device cpu --tiny --quick",
            file=sys.stderr,
        )
        return 2
    if folder is None:
        print(
            "coda bench: the benchmarks/ folder was not found (it is in the repository, not "
            "in the installed package): run from a checkout, or pass --benchmarks DIR",
            file=sys.stderr,
        )
        return 2
    missing = [n for n in names if not (folder / f"{n}.py").is_file()]
    if missing and args.only:
        print(f"coda bench: no script for {missing} in {folder}", file=sys.stderr)
        return 2
    names = tuple(n for n in names if n not in missing)
    tag = bench.device_tag(torch.cuda.get_device_name(0))
    print(f"coda bench: {len(names)} families from {folder} into {args.out} ({tag})", flush=True)
    results = bench.run_families(names, Path(args.out), folder, tag, args.quick)
    failed = [n for n, r in results.items() if r["returncode"] != 0]
    if failed:
        print(f"FAIL: {', '.join(failed)} (see their logs)")
        return 1
    print(f"PASS: {len(results)} families ran")
    return 0


def _demo(args: argparse.Namespace) -> int:
    import time

    from coda import demo_llama
    from coda.demo import run_demo

    def emit(line: str) -> None:
        print(line, flush=True)

    start = time.perf_counter()
    gpu = args.device == "gpu" or (args.device == "auto" and demo_llama.hopper())
    if args.device == "gpu" and not demo_llama.hopper():
        print("coda demo --device gpu: torch sees no Hopper (sm_90) GPU", file=sys.stderr)
        return 2
    note = demo_llama.gpu_note()
    if note and args.device != "cpu":
        print(note)
    results: dict[str, bool] = {}
    parts = [p for p in PARTS if p in args.parts]
    for i, part in enumerate(parts, 1):
        print(f"== [{i}/{len(parts)}] {part} ==", flush=True)
        if part == "rmsnorm":
            report = run_demo(
                M=args.m,
                N=args.n,
                K=args.k,
                N2=args.n2,
                tile=args.tile,
                subtile=args.subtile,
                seed=args.seed,
            )
        elif part == "train" and gpu:
            steps = args.steps or demo_llama.GPU_STEPS
            report = demo_llama.run_gpu_training(steps=steps, seed=args.seed, emit=emit)
        elif part == "train":
            report = demo_llama.run_training(steps=args.steps or 10, seed=args.seed, emit=emit)
        else:
            report = demo_llama.run_kernels(emit=emit)
        results[part] = report.passed
        print(flush=True)
    summary = ", ".join(f"{p} {'ok' if ok else 'FAIL'}" for p, ok in results.items())
    seconds = time.perf_counter() - start
    if all(results.values()):
        print(f"PASS: every check passed ({summary}) in {seconds:.0f} s")
        return 0
    print(f"FAIL: {summary} ({seconds:.0f} s)")
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m coda`` and the ``coda`` console script."""
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        return _demo(args)
    if args.command == "bench":
        return _bench(args)
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse rejects others


if __name__ == "__main__":
    sys.exit(main())
