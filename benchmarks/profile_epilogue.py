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

import attrs
import torch

from coda.mainloop.config import choose_epilogue_config
from coda.testing.catalog import EPILOGUES
from coda.testing.strategies import make_inputs


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
    A, B, t = make_inputs(epi, m, n, k, torch.bfloat16, seed=0)
    A, B = A.cuda(), B.cuda()
    t = {key: (v.cuda() if isinstance(v, torch.Tensor) else v) for key, v in t.items()}
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
