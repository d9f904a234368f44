"""GPU fuzzer: random compositions run fused on the GPU against eager references.

    python -m coda.testing.fuzz --examples 300 [--seed 0] [--workers 8] [--out fuzz.json]
                                [--staggered] [--cooperative] [--rolled]

Sits in ``coda.testing``; the same property the CPU suite checks, on the real kernel.
Each example draws an epilogue (``epilogues()``), a ragged problem size, an operand
layout (forward, dgrad, wgrad or the fourth major combination: :mod:`coda.testing.layouts`)
and inputs, runs ``epi(A, B, **tensors)`` with every output pre-filled with NaN (an element
the kernel never writes stays NaN), and compares each output with:

* ``truth``: ``epi.reference`` with a float64 accumulator (float64 GEMM);
* ``eager``: ``epi.reference`` with the GEMM output rounded to the operand dtype, i.e.
  what unfused eager PyTorch computes (a bf16 ``A @ B.T`` followed by the epilogue).

An output fails when ``err(coda) > 2 * err(eager) + atol`` (errors relative to
``max(|truth|, 1)``; atol 1e-3, or half an ulp at 1.0 of a 16-bit output dtype: one
rounding of the stored value, which flips when coda's fp32 math and torch's differ in
the last fp32 bit at a rounding boundary), or holds NaN/inf where the truth is finite. Examples are
drawn from one seeded hypothesis run; ``--workers`` processes split them (each compiles
its own kernels) and the parent merges their JSON into one summary. ``--staggered`` runs
every example with ``GemmConfig.staggered_copies`` on; ``--cooperative`` on cooperative
256 x 128 tiles (both warpgroups' epilogues at once on 128-row halves), where the
composition's buffers fit shared memory there (the record says which config ran);
``--rolled`` with ``GemmConfig.rolled_epilogue`` (each band's subtiles in a runtime loop).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any

import torch

from ..runtime.checks import kernels_run_on
from .tolerance import compare

if TYPE_CHECKING:
    from ..epilogue import Epilogue
    from ..mainloop.config import GemmConfig

ATOL = 1e-3


def check_example(
    epi: Epilogue,
    A: torch.Tensor,
    B: torch.Tensor,
    tensors: dict[str, Any],
    config: GemmConfig | None = None,
    reference_device: str | torch.device | None = None,
) -> dict[str, Any]:
    """Run one composition fused and compare it; returns a JSON-able record.

    ``reference_device`` (e.g. ``"cpu"``): compute the float64 and eager references and
    compare there, so that the GPU runs coda's kernels alone (under compute-sanitizer's
    racecheck, cuBLAS's kernels for the references would be instrumented too)."""
    from ..mainloop.config import choose_epilogue_config

    outputs = {}
    m, n, k = A.shape[0], B.shape[0], A.shape[1]
    cfg = config or choose_epilogue_config(m, n, k)
    cfg_tile = cfg.partials_tile  # a cooperative tile's partials are per 128-row half
    for spec in epi.outputs:  # every output NaN-poisoned: an unwritten element fails
        if spec.role != "scalar":
            outputs[spec.name] = torch.full(
                spec.shape(m, n, cfg_tile), float("nan"), dtype=spec.dtype, device=A.device
            )
    got = epi(A, B, config=cfg, outputs=outputs, check_contents=True, **tensors)
    torch.cuda.synchronize()
    if reference_device is not None:
        A, B = A.to(reference_device), B.to(reference_device)
        tensors = {
            key: v.to(reference_device) if isinstance(v, torch.Tensor) else v
            for key, v in tensors.items()
        }
        got = {key: v.to(reference_device) for key, v in got.items()}
    truth = epi.reference(A, B, tile=cfg_tile, acc=A.double() @ B.double().T, **tensors)
    eager = epi.reference(A, B, tile=cfg_tile, acc=(A @ B.T).float(), **tensors)
    record: dict[str, Any] = {"outputs": {}, "failed": False}
    for name, t in truth.items():
        try:
            atol = max(ATOL, torch.finfo(got[name].dtype).eps / 2)
            c = compare(got[name], t, name=name, baseline=eager[name], atol=atol, floor=1.0)
            entry = {"err": c.err, "eager_err": c.baseline_err, "limit": c.limit, "ok": c.passed}
        except AssertionError as e:  # non-finite where the truth is finite (e.g. unwritten)
            entry = {"ok": False, "error": str(e)}
        record["outputs"][name] = entry
        record["failed"] |= not entry["ok"]
    return record


def cooperative_config(epi, m: int, dtype: torch.dtype):
    """A cooperative 256 x 128 config for ``epi`` at ``m`` rows (a 2 x 1 cluster when
    there are two 256-row tiles), or None when its buffers do not fit shared memory."""
    from ..mainloop.config import GemmConfig
    from ..mainloop.dtypes import to_cutlass
    from ..mainloop.kernel import PingPongGemm
    from ..runtime.fused import FusedVisitor

    cfg = GemmConfig(tile_m=256, tile_n=128, cluster_m=2 if m > 256 else 1)
    try:
        PingPongGemm(cfg, to_cutlass(dtype), FusedVisitor(epi))
    except ValueError:
        return None
    return cfg


def _draw_and_run(
    seed: int,
    examples: int,
    worker: int,
    workers: int,
    out_path: str,
    staggered: bool = False,
    cooperative: bool = False,
    rolled: bool = False,
) -> None:
    import attrs
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st

    from ..mainloop.config import choose_epilogue_config
    from ..runtime.fused import n_multiple
    from .layouts import LAYOUTS, operands
    from .strategies import epilogues, make_inputs

    records: list[dict[str, Any]] = []
    counter = {"i": 0}

    @hseed(seed)
    @settings(
        max_examples=examples,
        phases=[Phase.generate],
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def body(data):
        i = counter["i"]
        counter["i"] += 1
        epi = data.draw(epilogues())
        m = data.draw(st.integers(1, 700))
        step = n_multiple(epi)
        n = step * data.draw(st.integers(1, 800 // step))
        k = 8 * data.draw(st.integers(1, 48))
        dtype = data.draw(st.sampled_from((torch.bfloat16, torch.float16)))
        layout = data.draw(st.sampled_from(sorted(LAYOUTS)))
        ex_seed = data.draw(st.integers(0, 2**31 - 1))
        if i % workers != worker:
            return
        A, B, tensors = make_inputs(epi, m, n, k, dtype, ex_seed)
        A, B = operands(A.cuda(), B.cuda(), layout)
        tensors = {
            k_: (v.cuda() if isinstance(v, torch.Tensor) else v) for k_, v in tensors.items()
        }
        rec = {
            "index": i,
            "M": m,
            "N": n,
            "K": k,
            "dtype": str(dtype),
            "layout": layout,
            "seed": ex_seed,
            "epilogue": epi.describe(),
        }
        config = None
        if staggered:
            config = attrs.evolve(choose_epilogue_config(m, n, k), staggered_copies=True)
            rec["staggered"] = True
        if rolled:
            config = attrs.evolve(choose_epilogue_config(m, n, k), rolled_epilogue=True)
            rec["rolled"] = True
        if cooperative:
            config = cooperative_config(epi, m, dtype)
            rec["config"] = "cooperative 256x128" if config else "default (does not fit)"
        t0 = time.time()
        try:
            rec.update(check_example(epi, A, B, tensors, config=config))
        except Exception as e:  # a crash is a failure, recorded with its message
            rec.update({"failed": True, "error": f"{type(e).__name__}: {e}"[:2000]})
        rec["seconds"] = time.time() - t0
        records.append(rec)

    body()
    with open(out_path, "w") as f:
        json.dump(records, f)


#: What the drawn compositions exercised: feature -> marker in ``Epilogue.describe()``.
_FEATURES = {
    "width_1/2_value": "width 1/2)",
    "width_2_value": "width 2)",
    "pairwise_reduce": "pairwise='reduce'",
    "pairwise_map": "pairwise='map'",
    "tile_load": "TileLoad(",
    "tile_store": "TileStore(",
    "col_vector": "per='col'",
    "row_vector": "per='row'",
    "row_reduce": " per row",
    "col_reduce": " per col",
    "log_sum_exp": "LogSumExp(",
    "target_select": "TargetSelect(",
}


def coverage(records: list[dict[str, Any]]) -> dict[str, int]:
    """How many examples used each feature, and how many had ragged M or N."""
    out = {f: sum(marker in r["epilogue"] for r in records) for f, marker in _FEATURES.items()}
    out["ragged_M_or_N"] = sum(r["M"] % 128 != 0 or r["N"] % 128 != 0 for r in records)
    out["cooperative_tiles"] = sum(r.get("config", "").startswith("coop") for r in records)
    for layout in sorted({r.get("layout", "fwd") for r in records}):
        out[f"layout_{layout}"] = sum(r.get("layout", "fwd") == layout for r in records)
    return out


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {value}")
    return value


def _gpu_problem() -> str | None:
    """Why the kernels cannot run in this process (no CUDA GPU, not a Hopper GPU), or None."""
    if not torch.cuda.is_available():
        return "no CUDA GPU (torch.cuda.is_available() is False)"
    if not kernels_run_on(torch.device("cuda", 0)):
        cap = torch.cuda.get_device_capability(0)
        return f"{torch.cuda.get_device_name(0)} is sm_{cap[0]}{cap[1]}, not sm_90"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m coda.testing.fuzz",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--examples", type=_positive, default=300, help="compositions to draw")
    p.add_argument("--seed", type=int, default=0, help="hypothesis seed (the same draws)")
    p.add_argument("--workers", type=_positive, default=1, help="processes, each drawing its share")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default="fuzz.json", help="the JSON report")
    p.add_argument(
        "--staggered", action="store_true", help="run with GemmConfig.staggered_copies on"
    )
    p.add_argument("--cooperative", action="store_true", help="run on cooperative 256-row tiles")
    p.add_argument("--rolled", action="store_true", help="run with GemmConfig.rolled_epilogue on")
    args = p.parse_args(argv)
    problem = _gpu_problem()
    if problem is not None:
        print(
            f"python -m coda.testing.fuzz: {problem}. The fuzzer runs coda's fused kernels, "
            "which need an NVIDIA Hopper GPU (sm_90: H100/H200). On a CPU machine the same "
            "property runs on the tile simulator: pytest tests/test_simulator_properties.py",
            file=sys.stderr,
        )
        return 2
    if args.worker is not None:
        _draw_and_run(
            args.seed,
            args.examples,
            args.worker,
            args.workers,
            args.part,
            args.staggered,
            args.cooperative,
            args.rolled,
        )
        return 0
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for w in range(args.workers):
            part = os.path.join(tmp, f"part{w}.json")
            cmd = [
                sys.executable,
                "-m",
                "coda.testing.fuzz",
                "--examples",
                str(args.examples),
                "--seed",
                str(args.seed),
                "--workers",
                str(args.workers),
                "--worker",
                str(w),
                "--part",
                part,
                *(["--staggered"] if args.staggered else []),
                *(["--cooperative"] if args.cooperative else []),
                *(["--rolled"] if args.rolled else []),
            ]
            procs.append((subprocess.Popen(cmd), part))
        records = []
        for proc, part in procs:
            proc.wait()
            if os.path.exists(part):
                with open(part) as f:
                    records += json.load(f)
    records.sort(key=lambda r: r["index"])
    failures = [r for r in records if r.get("failed")]
    import cutlass

    summary = {
        "examples": len(records),
        "failures": len(failures),
        "seed": args.seed,
        "staggered_copies": args.staggered,
        "cooperative": args.cooperative,
        "rolled_epilogue": args.rolled,
        "command": " ".join(["python -m coda.testing.fuzz", *(argv or sys.argv[1:])]),
        "versions": {
            "torch": torch.__version__,
            "nvidia-cutlass-dsl": cutlass.__version__,
            "device": torch.cuda.get_device_name(0),
        },
        "seconds": time.time() - t0,
        "coverage": coverage(records),
        "failed_examples": failures[:20],
    }
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(
        f"fuzz: {len(records)} examples, {len(failures)} failures, seed {args.seed}, "
        f"{summary['seconds']:.0f} s -> {args.out}"
    )
    for r in failures[:5]:
        print(json.dumps(r, indent=1)[:3000])
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
