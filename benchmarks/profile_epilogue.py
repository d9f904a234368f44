"""One fused launch of a catalogue epilogue between cudaProfilerStart/Stop, for Nsight Compute.

    ncu --clock-control none --profile-from-start off --launch-count 1 \\
        --section SourceCounters --section WarpStateStats --page source --csv \\
        --print-source sass python3 benchmarks/profile_epilogue.py swiglu_bwd > swiglu_bwd.csv

M=16384, N=K=2048 (``--m``, ``--nk``), the fused-epilogue config; three warm-up calls
(compile, load) run before the profiled one. ``results/ncu_stalls_h200.json`` summarizes
such profiles.
"""

from __future__ import annotations

import argparse
import os
import sys

import attrs
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from coda.mainloop.config import choose_epilogue_config  # noqa: E402
from coda.testing.catalog import EPILOGUES  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("epilogue", choices=sorted(EPILOGUES))
    p.add_argument("--m", type=int, default=16384)
    p.add_argument("--nk", type=int, default=2048)
    p.add_argument("--staggered", action="store_true", help="GemmConfig.staggered_copies")
    args = p.parse_args(argv)
    m, n, k = args.m, args.nk, args.nk
    cfg = choose_epilogue_config(m, n, k)
    if args.staggered:
        cfg = attrs.evolve(cfg, staggered_copies=True)
    epi = EPILOGUES[args.epilogue]
    A, B, t = common.cuda_inputs(epi, m, n, k)
    for _ in range(3):
        epi(A, B, config=cfg, **t)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    epi(A, B, config=cfg, **t)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(args.epilogue, cfg)


if __name__ == "__main__":
    main()
