"""coda.__main__: the command line, ``python -m coda <command>`` (also the ``coda`` script).

Commands:
  demo   compose the RMSNorm-forward epilogue (DESIGN.md section 5), run the reference and
         the tile simulator on random inputs, print the outputs and their agreement with
         textbook math; exit status 0 on PASS, 1 on FAIL.

Later issues add options to compile the fused kernel (CPU) and run it on a GPU.
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="coda", description="coda: Transformer epilogues fused into Hopper GEMMs."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="RMSNorm-forward epilogue: reference vs tile simulator vs textbook",
        description="Compose the deferred RMSNorm forward (two GEMM epilogues), run the "
        "reference and the CPU tile simulator, and report their agreement.",
    )
    demo.add_argument("--m", type=int, default=300, help="rows M (tokens), default 300")
    demo.add_argument("--n", type=int, default=520, help="hidden size N, default 520")
    demo.add_argument("--k", type=int, default=256, help="GEMM1 reduction K, default 256")
    demo.add_argument("--n2", type=int, default=384, help="GEMM2 output width, default 384")
    demo.add_argument("--tile", type=_pair, default=(128, 128), help="tile, default 128x128")
    demo.add_argument("--subtile", type=_pair, default=(64, 32), help="subtile, default 64x32")
    demo.add_argument("--seed", type=int, default=0, help="random seed, default 0")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m coda`` and the ``coda`` console script."""
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from coda.demo import run_demo

        report = run_demo(
            M=args.m,
            N=args.n,
            K=args.k,
            N2=args.n2,
            tile=args.tile,
            subtile=args.subtile,
            seed=args.seed,
        )
        return 0 if report.passed else 1
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse rejects others


if __name__ == "__main__":
    sys.exit(main())
