"""SASS snapshots of a fixed set of coda kernels: prove a refactor changes no machine code.

Sits in ``coda.testing`` (it builds kernels from the catalogue, so it stands above
``coda.runtime``). Works on a GPU-less machine: every kernel is compiled for sm_90a
(``CUTE_DSL_ARCH=sm_90a``) and disassembled with ``nvdisasm`` (``coda.runtime.sass``)::

    python -m coda.testing.sass_snapshot write before/      # on the code before a change
    python -m coda.testing.sass_snapshot write after/       # on the code after it
    python -m coda.testing.sass_snapshot compare before/ after/

``write`` compiles :data:`KERNELS` (``--only name,...`` for some) with the disk cache off
and writes ``<name>.sass`` per kernel; ``compare`` lists each kernel as SAME or DIFF (and
exits 1 on any DIFF or missing file); ``counts DIR [DIR2]`` prints each kernel's
instruction profile (``coda.runtime.sass.instruction_profile``: all instructions, the FP32
pipe's, MUFU, SHFL, IMAD, spills, adds of zero), before -> after given two folders, for a
change meant to take instructions out rather than keep the code the same. The set covers
the mainloop's schedules and the epilogue paths a change to ``coda.mainloop.kernel`` can
touch: PingPong and cooperative tiles, split-K, 2 x 2 clusters, operand layouts, M x N
loads and stores, row and column reductions (on cooperative and on 128 x 192 PingPong
tiles), the kernel's own finalize, the concurrent epilogues of a map pass, staggered
copies, the rolled epilogue and 64-column subtiles. (Used on 2026-11-28: moving the
tile's mainloop and the epilogue's parts into helpers of ``PingPongGemm`` left all of
them bitwise identical; and on 2026-11-29: moving the epilogue driver and the CTA's
roles into modules of their own, likewise.)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable

import torch

#: name -> a function building the kernel's ``GemmKernelKey`` (called lazily: it imports
#: the runtime)
KERNELS: dict[str, Callable[[], object]] = {}


def _kernel(name: str):
    def register(build):
        KERNELS[name] = build
        return build

    return register


def _key(config, visitor=None, a_major="k", b_major="k"):
    from coda.runtime import gemm_kernels

    if visitor is None:
        return gemm_kernels.GemmKernelKey(config, torch.bfloat16, a_major=a_major, b_major=b_major)
    return gemm_kernels.GemmKernelKey(
        config, torch.bfloat16, visitor, a_major=a_major, b_major=b_major
    )


def _pingpong(**kw):
    from coda.mainloop.config import GemmConfig

    return GemmConfig(**{"tile_n": 128, "cluster_m": 2, **kw})


def _fused(name: str, in_kernel: bool = False):
    from coda.runtime.fused import FusedVisitor
    from coda.testing.catalog import EPILOGUES

    return FusedVisitor(EPILOGUES[name], in_kernel)


@_kernel("plain_fwd")
def _plain_fwd():
    return _key(_pingpong())


@_kernel("plain_wgrad_coop")
def _plain_wgrad_coop():
    from coda.mainloop.config import GemmConfig

    coop = GemmConfig(tile_m=256, tile_n=128, cluster_m=1, cluster_n=2)
    return _key(coop, a_major="m", b_major="n")


@_kernel("plain_split2_accumulate")
def _plain_split2():
    from coda.mainloop.visitor import AccStore

    return _key(_pingpong(split_k=2), AccStore(torch.float32, accumulate=True))


@_kernel("swiglu_bwd_fwd")
def _swiglu_bwd():
    return _key(_pingpong(), _fused("swiglu_bwd"))


@_kernel("rmsnorm_fwd_dgrad_in_kernel_finalize")
def _rmsnorm_in_kernel():
    return _key(_pingpong(), _fused("rmsnorm_fwd", True), b_major="n")


@_kernel("dgamma_colsum_coop")
def _dgamma_coop():
    from coda.mainloop.config import GemmConfig

    coop = GemmConfig(tile_m=256, tile_n=128, cluster_m=1, cluster_n=2)
    return _key(coop, _fused("dgamma_colsum"))


@_kernel("dgamma_colsum_wide_tile")
def _dgamma_wide():
    # PingPong 128 x 192, the warpgroups taking turns: each with its own column scratch
    return _key(_pingpong(tile_n=192), _fused("dgamma_colsum"))


@_kernel("lse_target_map_pass_concurrent")
def _lse_map():
    from coda.runtime.epilogue_kernels import epilogue_choice
    from coda.testing.catalog import EPILOGUES

    epi = EPILOGUES["lse_target"]
    config = epilogue_choice(epi, torch.bfloat16, 8192, 8192, 8, num_sms=132)[0]
    return _key(config, _fused("lse_target"))


@_kernel("swiglu_bwd_staggered")
def _swiglu_staggered():
    return _key(_pingpong(staggered_copies=True), _fused("swiglu_bwd"))


@_kernel("rope_rolled")
def _rope_rolled():
    return _key(_pingpong(rolled_epilogue=True), _fused("rope"))


@_kernel("residual_store_2x2_wgrad")
def _residual_2x2():
    return _key(_pingpong(cluster_n=2), _fused("residual_store"), a_major="m", b_major="n")


@_kernel("silu_max_epi64")
def _silu_epi64():
    return _key(_pingpong(epi_n=64), _fused("silu_max"))


def write(folder: str, only: list[str] | None = None) -> dict[str, str]:
    """Compile and disassemble the kernels (``only`` some of them) into ``folder``, with
    coda's disk cache off meanwhile (a cached object is not this code's); returns
    {name: path}."""
    from coda.runtime import gemm_kernels
    from coda.runtime.sass import disassemble

    names = list(KERNELS) if not only else only
    unknown = [n for n in names if n not in KERNELS]
    if unknown:
        raise ValueError(f"unknown kernels {unknown}; known: {', '.join(KERNELS)}")
    os.makedirs(folder, exist_ok=True)
    written = {}
    saved = os.environ.get("CODA_DISK_CACHE")
    os.environ["CODA_DISK_CACHE"] = "0"
    try:
        for name in names:
            with tempfile.TemporaryDirectory() as tmp:
                _, cubin = gemm_kernels.compile_artifacts(KERNELS[name](), tmp)
            path = os.path.join(folder, f"{name}.sass")
            with open(path, "w") as f:
                f.write(disassemble(cubin))
            written[name] = path
            print(f"{name}: {path}", flush=True)
    finally:
        if saved is None:
            del os.environ["CODA_DISK_CACHE"]
        else:
            os.environ["CODA_DISK_CACHE"] = saved
    return written


def compare(before: str, after: str) -> dict[str, str]:
    """{kernel name: "SAME" | "DIFF" | "MISSING"} for every ``.sass`` in either folder."""
    names = sorted({f[:-5] for d in (before, after) for f in os.listdir(d) if f.endswith(".sass")})
    verdict = {}
    for name in names:
        paths = [os.path.join(d, f"{name}.sass") for d in (before, after)]
        if not all(os.path.exists(p) for p in paths):
            verdict[name] = "MISSING"
            continue
        with open(paths[0]) as a, open(paths[1]) as b:
            verdict[name] = "SAME" if a.read() == b.read() else "DIFF"
    return verdict


def counts(folder: str) -> dict[str, dict[str, int]]:
    """{kernel name: ``coda.runtime.sass.instruction_profile``} of every ``.sass`` in a
    folder written by ``write``."""
    from coda.runtime.sass import instruction_profile

    found = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".sass"):
            with open(os.path.join(folder, f)) as text:
                found[f[:-5]] = instruction_profile(text.read())
    return found


def _print_counts(folders: list[str]) -> None:
    tables = [counts(d) for d in folders]
    names = sorted({n for t in tables for n in t})
    keys = list(next((p for t in tables for p in t.values()), {}))
    print("kernel".ljust(40) + "".join(k.rjust(14) for k in keys))
    for name in names:
        cells = []
        for k in keys:
            got = [str(t[name][k]) if name in t else "-" for t in tables]
            cells.append(" -> ".join(got).rjust(14))
        print(name.ljust(40) + "".join(cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="compile the kernels and write their SASS")
    w.add_argument("folder")
    w.add_argument("--only", default="", help="comma-separated kernel names")
    c = sub.add_parser("compare", help="compare two folders written by 'write'")
    c.add_argument("before")
    c.add_argument("after")
    k = sub.add_parser(
        "counts", help="instruction counts (FP32 pipe, MUFU, ...) of one folder, or before -> after"
    )
    k.add_argument("folders", nargs="+")
    args = parser.parse_args(argv)
    if args.command == "write":
        write(args.folder, [n for n in args.only.split(",") if n] or None)
        return 0
    if args.command == "counts":
        _print_counts(args.folders)
        return 0
    verdict = compare(args.before, args.after)
    for name, state in verdict.items():
        print(f"{state:8s}{name}")
    return 0 if verdict and all(v == "SAME" for v in verdict.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
