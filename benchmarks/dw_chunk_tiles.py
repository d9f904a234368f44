"""The LM-head loss's row-chunk dW GEMM under candidate tiles, beside cuBLAS's whole dW.

    python benchmarks/dw_chunk_tiles.py [--H 4096,2048] [--rows 2048] [--chunks 8]
        [--V 128256] [--rounds 5] [--out benchmarks/results/dw_chunk_tiles_h200.json]

``linear_cross_entropy``'s gradient-in-forward path adds each row chunk's
dW = dlogits_c.T @ h_c (V x H, K = the chunk's rows; A M-major, B N-major) into an fp32
V x H sum with TMA reduce-add (``ce_fused.CHUNK_DW_TILES`` picks its tile). This times
``--chunks`` such GEMMs back to back under each candidate config (PingPong 128 x 128 /
160 / 192 in 2 x 1, 1 x 2, 1 x 1 and 2 x 2 clusters, two other swizzle groups, and
cooperative 256-row tiles), beside cuBLAS's dW of all ``rows * chunks`` rows in one GEMM
(bf16 out: what torch.compile's loss runs), in interleaved rounds, medians
(benchmarks/common.py). JSON ``{device, versions, command, "rows": [{"H", "V",
"rows", "chunks", "config", "ms", "heuristic"}]}`` (config "cublas_full_dW" for
cuBLAS; ``heuristic``: ``choose_config``'s pick for the chunk's GEMM).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from coda.mainloop.config import GemmConfig, choose_config  # noqa: E402
from coda.matmul import gemm  # noqa: E402

CONFIGS = {
    "pp128x128c21g8": GemmConfig(tile_m=128, tile_n=128, cluster_m=2, group_m=8),
    "pp128x128c21g4": GemmConfig(tile_m=128, tile_n=128, cluster_m=2, group_m=4),
    "pp128x128c21g16": GemmConfig(tile_m=128, tile_n=128, cluster_m=2, group_m=16),
    "pp128x128c12": GemmConfig(tile_m=128, tile_n=128, cluster_m=1, cluster_n=2),
    "pp128x128c11": GemmConfig(tile_m=128, tile_n=128, cluster_m=1, cluster_n=1),
    "pp128x128c22": GemmConfig(tile_m=128, tile_n=128, cluster_m=2, cluster_n=2),
    "pp128x160c21": GemmConfig(tile_m=128, tile_n=160, cluster_m=2),
    "pp128x192c21": GemmConfig(tile_m=128, tile_n=192, cluster_m=2),
    "pp128x192c12": GemmConfig(tile_m=128, tile_n=192, cluster_m=1, cluster_n=2),
    "co256x128c21": GemmConfig(tile_m=256, tile_n=128, cluster_m=2),
    "co256x192c21": GemmConfig(tile_m=256, tile_n=192, cluster_m=2),
    "co256x128c12": GemmConfig(tile_m=256, tile_n=128, cluster_m=1, cluster_n=2),
}


def shape_rows(H: int, V: int, rows: int, chunks: int, rounds: int) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    hc = torch.randn(rows, H, device="cuda", generator=g).to(torch.bfloat16)
    dlc = (torch.randn(rows, V, device="cuda", generator=g) / 8).to(torch.bfloat16)
    dW32 = torch.zeros(V, H, dtype=torch.float32, device="cuda")
    h = hc.repeat(chunks, 1)  # cuBLAS's whole-M operands: the same chunk, `chunks` times
    dl = dlc.repeat(chunks, 1)
    dW = torch.empty(V, H, dtype=torch.bfloat16, device="cuda")
    fns = {"cublas_full_dW": lambda: torch.mm(dl.t(), h, out=dW)}
    for name, cfg in CONFIGS.items():

        def chunked(cfg=cfg):
            for _ in range(chunks):
                gemm(dlc.t(), hc.t(), out=dW32, accumulate=True, config=cfg)

        fns[name] = chunked
    times = common.interleaved(fns, rounds=rounds, reps=2, warmup=1)
    heuristic = choose_config(V, H, rows, torch.cuda.get_device_properties(0).multi_processor_count)
    out = []
    for name, ts in times.items():
        cfg = CONFIGS.get(name)
        out.append(
            {
                "H": H, "V": V, "rows": rows, "chunks": chunks, "config": name,
                "ms": common.median(ts), "heuristic": cfg is not None and cfg == heuristic,
            }
        )  # fmt: skip
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--H", default="4096,2048")
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--V", type=int, default=128256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/dw_chunk_tiles_h200.json")
    args = p.parse_args(argv)
    rows = []
    for H in (int(x) for x in args.H.split(",")):
        rows += shape_rows(H, args.V, args.rows, args.chunks, args.rounds)
        torch.cuda.empty_cache()
    common.write_json(args.out, {**common.environment(), "rows": rows})
    ranked = sorted(rows, key=lambda r: (-r["H"], r["ms"]))
    common.print_table(ranked, ["H", "config", "ms", "heuristic"])


if __name__ == "__main__":
    main()
