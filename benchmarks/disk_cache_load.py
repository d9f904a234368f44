"""Warm load of a disk-cached GEMM kernel in a fresh process, against its cold compile.

    python benchmarks/disk_cache_load.py [--cache-dir DIR] [--loads 5] [--size 4096]

One child process compiles the kernel (``get_kernel`` on an empty ``$CODA_CACHE_DIR``)
and stores it; then ``--loads`` fresh child processes each time ``get_kernel`` again,
with ``cute.compile`` patched to fail, so the kernel must come from disk. On a GPU every
child also launches its kernel once (the first launch hands the cubin to the driver, for
a compiled and a loaded function alike) and checks D against torch. Prints one JSON line:

    {"kernel", "cold_compile_s", "warm_load_ms" (median), "warm_load_ms_all",
     "import_s" (importing torch + CuTeDSL, paid by any process that launches a kernel),
     "first_launch_ms_compiled", "first_launch_ms_loaded", "max_abs_err_loaded", ...}

Runs on a CPU-only machine too (no launches then).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
import attrs, torch
import cutlass.cute as cute
from coda.mainloop.config import GemmConfig
from coda.runtime import disk_cache, gemm_kernels as gk
import_s = time.perf_counter() - t0

mode, size = sys.argv[1], int(sys.argv[2])
if mode == "load":
    def forbidden(*a, **k):
        raise AssertionError("compiled although the disk cache holds this kernel")
    cute.compile = forbidden
    gk.compile_kernel = forbidden

# Where the warm time goes: the canonical key (hashes coda's sources once per process) and
# the disk load proper (read, checksum, link the object, look the function up).
parts = {}
def timed(name, f):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            parts[name] = parts.get(name, 0.0) + (time.perf_counter() - t) * 1e3
    return wrapper
disk_cache.canonical_key = timed("key_ms", disk_cache.canonical_key)
disk_cache.load = timed("disk_load_ms", disk_cache.load)

cfg = GemmConfig(tile_n=128, cluster_m=1)
key = gk.GemmKernelKey(cfg, torch.bfloat16)
t = time.perf_counter()
fn = gk.get_kernel(key)
get_s = time.perf_counter() - t
out = {"mode": mode, "import_s": import_s, "get_kernel_s": get_s, "stats": dict(disk_cache.stats),
       "kernel": repr(key), "parts": parts}

if torch.cuda.is_available():
    torch.manual_seed(0)
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    d = torch.zeros(size, size, device="cuda", dtype=torch.bfloat16)
    ref = (a.float() @ b.float().T)
    torch.cuda.synchronize()

    def launch():
        gk.launch(key, a, b, (d,))

    t = time.perf_counter()
    launch()
    torch.cuda.synchronize()
    out["first_launch_ms"] = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    launch()
    torch.cuda.synchronize()
    out["second_launch_ms"] = (time.perf_counter() - t) * 1e3
    out["max_abs_err"] = (d.float() - ref).abs().max().item()
    out["ref_max_abs"] = ref.abs().max().item()
    out["device"] = torch.cuda.get_device_name(0)
print(json.dumps(out))
"""


def run_child(mode: str, size: int, env: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(size)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"{mode} child failed (rc {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-dir", help="cache directory (default: a fresh temporary one)")
    ap.add_argument("--loads", type=int, default=5, help="fresh load processes to time")
    ap.add_argument("--size", type=int, default=4096, help="M = N = K of the check launch")
    args = ap.parse_args()

    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="coda-disk-cache-")
    env = dict(os.environ)
    env["CODA_CACHE_DIR"] = cache_dir
    env.pop("CODA_DISK_CACHE", None)
    env.setdefault("CUTE_DSL_ARCH", "sm_90a")
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")

    cold = run_child("compile", args.size, env)
    if cold["stats"] != {"miss": 1, "store": 1}:
        raise SystemExit(f"expected a cold compile and a store, got {cold['stats']}")
    warm = [run_child("load", args.size, env) for _ in range(args.loads)]
    for w in warm:
        if w["stats"] != {"hit": 1}:
            raise SystemExit(f"expected a disk hit, got {w['stats']}")
    load_ms = [w["get_kernel_s"] * 1e3 for w in warm]
    result = {
        "kernel": cold["kernel"],
        "cold_compile_s": round(cold["get_kernel_s"], 4),
        "warm_load_ms": round(statistics.median(load_ms), 3),
        "warm_load_ms_all": [round(x, 3) for x in load_ms],
        "warm_load_breakdown_ms": {
            name: round(statistics.median(w["parts"][name] for w in warm), 3)
            for name in ("key_ms", "disk_load_ms")
        },
        "import_s": round(statistics.median(w["import_s"] for w in warm), 4),
        "cache_dir": cache_dir,
        "entry_bytes": sum(
            os.path.getsize(os.path.join(cache_dir, f)) for f in os.listdir(cache_dir)
        ),
    }
    if "first_launch_ms" in cold:
        result.update(
            device=cold["device"],
            size=args.size,
            first_launch_ms_compiled=round(cold["first_launch_ms"], 3),
            first_launch_ms_loaded=round(statistics.median(w["first_launch_ms"] for w in warm), 3),
            second_launch_ms_loaded=round(
                statistics.median(w["second_launch_ms"] for w in warm), 3
            ),
            max_abs_err_compiled=cold["max_abs_err"],
            max_abs_err_loaded=max(w["max_abs_err"] for w in warm),
            ref_max_abs=cold["ref_max_abs"],
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
