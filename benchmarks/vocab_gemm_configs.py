"""coda.gemm under every candidate config beside cuBLAS, for the LM head's backward GEMMs.

    python benchmarks/vocab_gemm_configs.py [--H 2048,4096,8192] [--M 8192,16384]
        [--V 128256] [--rounds 3] [--tiles 128,160,192] [--clusters 2x1,1x2,1x1,2x2]
        [--swizzles 4,16] [--tile-m 128,256]
        [--out benchmarks/results/vocab_gemm_configs_h200.json]

The cross-entropy's backward pair at vocabulary shapes (``benchmarks/cross_entropy.py``'s
floor) are the GEMMs where coda trails cuBLAS: dh = dlogits @ W (M x H, K = V: B is
N-major) and dW = dlogits.T @ h (V x H, K = M: A M-major, B N-major). For each (H, M)
this times the config ``choose_config`` picks (``heuristic``), every tile width x
cluster shape of the mainloop (``--tile-m 128,256`` adds the cooperative 256-row tiles
of each), and two tile-scheduler swizzles, beside ``torch.mm`` on
the same views; interleaved rounds, medians (benchmarks/common.py). Rows:
``{"gemm", "H", "M", "V", "M_", "N_", "K_", "config", "coda_ms", "cublas_ms",
"heuristic"}`` (M_, N_, K_: the GEMM's own problem).
"""

from __future__ import annotations

import argparse
import os
import sys

import attrs
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from coda.mainloop.config import GemmConfig, choose_config  # noqa: E402
from coda.matmul import gemm  # noqa: E402

CLUSTERS = ((2, 1), (1, 2), (1, 1), (2, 2))
TILES = (128, 160, 192)
SWIZZLES = (4, 16)


def label(cfg: GemmConfig) -> str:
    return f"{cfg.tile_m}x{cfg.tile_n} c{cfg.cluster_m}x{cfg.cluster_n} g{cfg.group_m}"


def candidates(
    base: GemmConfig, tiles=TILES, clusters=CLUSTERS, swizzles=SWIZZLES, tile_ms=(128,)
) -> list[GemmConfig]:
    out = [base]
    for tile_m in tile_ms:
        for tile_n in tiles:
            for cm, cn in clusters:
                out.append(GemmConfig(tile_m=tile_m, tile_n=tile_n, cluster_m=cm, cluster_n=cn))
    out += [attrs.evolve(base, group_m=g) for g in swizzles]
    seen, unique = set(), []
    for c in out:
        if c not in seen:
            seen.add(c)
            unique.append(c)
    return unique


def problems(H: int, M: int, V: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(M, H, device="cuda", generator=g).to(torch.bfloat16)
    W = (torch.randn(V, H, device="cuda", generator=g) / H**0.5).to(torch.bfloat16)
    dl = (torch.randn(M, V, device="cuda", generator=g) / V**0.5).to(torch.bfloat16)
    dh, dW = torch.empty_like(h), torch.empty_like(W)
    # (name, A, B, out, the same product on cuBLAS)
    yield "dh", dl, W.t(), dh, lambda: torch.mm(dl, W, out=dh)
    yield "dW", dl.t(), h.t(), dW, lambda: torch.mm(dl.t(), h, out=dW)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--H", default="2048,4096,8192")
    p.add_argument("--M", default="8192,16384")
    p.add_argument("--V", type=int, default=128256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tiles", default=",".join(map(str, TILES)), help="tile widths to try")
    p.add_argument(
        "--clusters", default=",".join(f"{m}x{n}" for m, n in CLUSTERS), help="e.g. 2x1,2x2"
    )
    p.add_argument("--swizzles", default=",".join(map(str, SWIZZLES)), help="'' for none")
    p.add_argument("--tile-m", default="128", help="128 (PingPong), 256 (cooperative)")
    p.add_argument("--out", default="benchmarks/results/vocab_gemm_configs_h200.json")
    args = p.parse_args(argv)
    tiles = tuple(int(t) for t in args.tiles.split(",") if t)
    clusters = tuple(tuple(int(x) for x in c.split("x")) for c in args.clusters.split(",") if c)
    swizzles = tuple(int(g) for g in args.swizzles.split(",") if g)
    tile_ms = tuple(int(t) for t in args.tile_m.split(",") if t)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for H in (int(x) for x in args.H.split(",")):
        for M in (int(x) for x in args.M.split(",")):
            for name, A, B, out, cublas in problems(H, M, args.V):
                m, k, n = A.shape[0], A.shape[1], B.shape[0]
                base = choose_config(m, n, k, sms)
                cfgs = candidates(base, tiles, clusters, swizzles, tile_ms)
                fns = {"cublas": cublas}
                for c in cfgs:
                    fns[label(c)] = lambda c=c, A=A, B=B, out=out: gemm(A, B, out=out, config=c)
                reps = max(2, min(10, int(2e14 / (2 * m * n * k))))
                times = common.interleaved(fns, rounds=args.rounds, reps=reps, warmup=1)
                cub = common.median(times["cublas"])
                for c in cfgs:
                    rows.append(
                        {
                            "gemm": name, "H": H, "M": M, "V": args.V, "M_": m, "N_": n,
                            "K_": k, "config": label(c),
                            "coda_ms": common.median(times[label(c)]), "cublas_ms": cub,
                            "heuristic": c == base,
                        }
                    )  # fmt: skip
                best = min((r for r in rows[-len(cfgs) :]), key=lambda r: r["coda_ms"])
                heur = next(r for r in rows[-len(cfgs) :] if r["heuristic"])
                print(
                    f"{name} H={H} M={M}: cuBLAS {cub:.3f} ms, heuristic {heur['config']} "
                    f"{heur['coda_ms']:.3f}, best {best['config']} {best['coda_ms']:.3f}",
                    flush=True,
                )
                del A, B, out
                common.write_json(args.out, {**common.environment(), "rows": rows})
                torch.cuda.empty_cache()
    common.print_table(rows, ["gemm", "H", "M", "config", "coda_ms", "cublas_ms", "heuristic"])


if __name__ == "__main__":
    main()
