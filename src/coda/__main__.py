"""coda.__main__: the command line, ``python -m coda <command>`` (also the ``coda`` script).

Commands:
  demo   three sections, each with its own checks; exit status 0 when all pass (PASS), else 1:
         1. rmsnorm: compose the RMSNorm-forward epilogue (DESIGN.md section 5), run the
            reference and the tile simulator on random inputs, print the outputs and their
            agreement with textbook math (coda.demo);
         2. train: a tiny transformers Llama patched with apply_coda trains a few AdamW steps
            on the CPU reference path next to eager PyTorch (fp32, float64) (coda.demo_llama);
         3. kernels: one decoder layer's fused GEMM kernels compiled for sm_90a, with what
            their SASS contains: HGMMA, TMA, spills (coda.demo_llama).
         The GPU training comparison is not implemented yet (a GPU machine runs the above).
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
        "2. train: a tiny transformers Llama patched with apply_coda trains on the CPU "
        "reference path next to eager PyTorch (fp32 and float64). 3. kernels: one decoder "
        "layer's fused kernels compiled for sm_90a, and what their SASS contains. The GPU "
        "training comparison is not implemented yet.",
    )
    demo.add_argument("--m", type=int, default=300, help="rows M (tokens), default 300")
    demo.add_argument("--n", type=int, default=520, help="hidden size N, default 520")
    demo.add_argument("--k", type=int, default=256, help="GEMM1 reduction K, default 256")
    demo.add_argument("--n2", type=int, default=384, help="GEMM2 output width, default 384")
    demo.add_argument("--tile", type=_pair, default=(128, 128), help="tile, default 128x128")
    demo.add_argument("--subtile", type=_pair, default=(64, 32), help="subtile, default 64x32")
    demo.add_argument("--seed", type=int, default=0, help="random seed, default 0")
    demo.add_argument(
        "--steps", type=_positive, default=10, help="training steps of section 2, default 10"
    )
    demo.add_argument(
        "--parts",
        type=_parts,
        default=PARTS,
        help=f"comma-separated sections to run, default {','.join(PARTS)}",
    )
    return parser


def _demo(args: argparse.Namespace) -> int:
    import time

    from coda import demo_llama
    from coda.demo import run_demo

    def emit(line: str) -> None:
        print(line, flush=True)

    start = time.perf_counter()
    note = demo_llama.gpu_note()
    if note:
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
        elif part == "train":
            report = demo_llama.run_training(steps=args.steps, seed=args.seed, emit=emit)
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
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse rejects others


if __name__ == "__main__":
    sys.exit(main())
