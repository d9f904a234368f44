"""CPU tests of a fused call's host path (``coda.runtime.epilogue_kernels``) with the
kernel launch replaced by a recorder: what travels to the kernel, which finalize runs
where, the per-stream scratch, and the repeated-call signature cache (fail-closed).

The GPU tests (tests/test_fused_gpu.py) run the same path for real; here the launch
arguments themselves are checked, on CPU tensors standing in for CUDA ones."""

from __future__ import annotations

import math

import pytest
import torch

from coda.caches import BoundedCache
from coda.errors import InputError
from coda.mainloop.config import GemmConfig
from coda.mainloop.scheduler import host_tile_order
from coda.runtime import checks, epilogue_kernels, finalize, gemm_kernels
from coda.runtime.fused import counter_slots, in_kernel_axes, padded_tiles
from coda.testing.catalog import EPILOGUES
from coda.testing.strategies import make_inputs

CONFIG = GemmConfig(tile_n=128, cluster_m=2)


class Recorder:
    """Stands in for compiled kernels: records every launch's arguments."""

    def __init__(self):
        self.gemm: list[tuple] = []
        self.finalize: list[tuple] = []


@pytest.fixture
def rec(monkeypatch):
    r = Recorder()
    cpu = torch.device("cpu")
    monkeypatch.setitem(checks._hopper_ok, cpu, 132)
    monkeypatch.setattr(gemm_kernels, "launcher", lambda key: lambda *a: r.gemm.append(a))
    monkeypatch.setattr(gemm_kernels, "local_memory_bytes", lambda key: 0)
    monkeypatch.setattr(
        finalize.FinalizeKey, "compile", lambda self, options=None: lambda *a: r.finalize.append(a)
    )
    capturing = {"on": False}
    # (CPU builds of torch lack the CUDA stream queries)
    monkeypatch.setattr(
        torch._C, "_cuda_isCurrentStreamCapturing", lambda: capturing["on"], raising=False
    )
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7, raising=False)
    monkeypatch.setattr(gemm_kernels, "get_compiled", lambda kind, key, compile_fn: compile_fn(key))
    monkeypatch.setattr(epilogue_kernels, "_plans", BoundedCache(4096))
    monkeypatch.setattr(epilogue_kernels, "_calls", BoundedCache(4096))
    monkeypatch.setattr(epilogue_kernels, "_scratches", {})
    r.capturing = capturing
    return r


def _inputs(name, m, n, k, seed=0):
    epi = EPILOGUES[name]
    A, B, tensors = make_inputs(epi, m, n, k, torch.bfloat16, seed=seed)
    return epi, A, B, tensors


def test_in_gemm_finalize_rule():
    rms, dgamma = EPILOGUES["rmsnorm_fwd"], EPILOGUES["dgamma_colsum"]
    assert in_kernel_axes(rms) == (True, False)
    assert in_kernel_axes(dgamma) == (False, True)
    assert in_kernel_axes(EPILOGUES["swiglu_fwd"]) is None  # nothing to finalize
    assert finalize.in_gemm(rms, CONFIG, 512, 8192, 132)
    assert not finalize.in_gemm(rms, CONFIG, 128, 8200, 132)  # an LM head's rows: the kernel
    assert finalize.in_gemm(dgamma, CONFIG, 4096, 1024, 132)
    assert not finalize.in_gemm(dgamma, CONFIG, 4100, 512, 132)  # a long column: its tail
    # each warpgroup arrives about once: up to 2 tiles of 128 x 128 per SM
    assert finalize.in_gemm(rms, CONFIG, 2048, 2048, 132)  # 256 tiles
    assert not finalize.in_gemm(rms, CONFIG, 16384, 2048, 132)  # a GEMM of 2048 tiles
    assert not finalize.in_gemm(rms, CONFIG, 16384, 4096, 132)  # a map pass's 4096 tiles
    assert finalize.in_gemm(rms, CONFIG, 16384, 2048, 1024)  # ... on a larger GPU
    assert not finalize.in_gemm(rms, GemmConfig(tile_m=256), 1024, 1024, 132)
    assert not finalize.in_gemm(rms, GemmConfig(split_k=2), 1024, 1024, 132)


@pytest.mark.parametrize("m,n", [(1000, 776), (128, 128), (7, 8), (4096, 1024)])
@pytest.mark.parametrize("cluster", [(2, 1), (1, 2), (2, 2), (1, 1)])
def test_counter_slots_cover_every_scheduled_tile(m, n, cluster):
    """The kernel expects, per row (column) of tiles, as many arrivals as the scheduler
    hands out tiles there: whole clusters, tiles past the edge included."""
    cfg = GemmConfig(tile_n=128, cluster_m=cluster[0], cluster_n=cluster[1])
    cm = math.ceil(math.ceil(m / 128) / cluster[0])  # clusters along M and N
    cn = math.ceil(math.ceil(n / 128) / cluster[1])
    tiles = [
        (i * cluster[0] + a, j * cluster[1] + b)
        for i, j in host_tile_order(cm, cn, 8)
        for a in range(cluster[0])
        for b in range(cluster[1])
    ]
    rows_m = padded_tiles(m, 128, cluster[0])
    rows_n = padded_tiles(n, 128, cluster[1])
    assert max(t[0] for t in tiles) < rows_m and max(t[1] for t in tiles) < rows_n
    for i in range(rows_m):
        assert sum(t[0] == i for t in tiles) == rows_n
    for j in range(rows_n):
        assert sum(t[1] == j for t in tiles) == rows_m
    assert counter_slots(cfg, m, n) == rows_m + rows_n


def test_in_kernel_finalize_launches_once_with_counters(rec):
    epi, A, B, tensors = _inputs("rmsnorm_fwd", 300, 520, 64)
    out = epi(A, B, config=CONFIG, **tensors)
    assert len(rec.gemm) == 1 and not rec.finalize  # no finalize launch
    *_, extras = rec.gemm[0]
    counters = extras[-1]
    assert counters.dtype == torch.int32 and not counters.any()
    assert counters.numel() >= counter_slots(CONFIG, 300, 520)
    # the result is written by the kernel (an extra); the partials are scratch
    assert out["rstd"] is extras[-2]
    assert set(out) == {"x", "h", "rstd"}


def test_finalize_kernel_runs_when_rows_are_long(rec, monkeypatch):
    """Without early finalizes the GEMM takes no counters and the finalize kernel waits
    for the whole grid (it is handed a stand-in counter tensor and 0 arrivals)."""
    monkeypatch.setattr(finalize, "EARLY_ROWS", False)
    epi, A, B, tensors = _inputs("rmsnorm_fwd", 64, finalize.ROWS_IN_GEMM_MAX_N + 8, 64)
    out = epi(A, B, config=CONFIG, **tensors)
    assert len(rec.gemm) == 1 and len(rec.finalize) == 1
    *_, extras = rec.gemm[0]
    assert not any(t.dtype == torch.int32 for t in extras if isinstance(t, torch.Tensor))
    ((written, counters, m, n, _, arrivals),) = rec.finalize
    assert any(out["rstd"] is t for t in written)  # the finalize kernel writes the result
    assert counters.dtype == torch.int32 and arrivals == 0


@pytest.mark.parametrize("m,n", [(64, finalize.ROWS_IN_GEMM_MAX_N + 8), (16384, 2048), (300, 9000)])
def test_early_finalize_hands_the_gemms_counters_to_the_finalize_kernel(rec, m, n, monkeypatch):
    """Row results finalized by the kernel early (the default): the GEMM takes the stream's
    zeroed counters (an arrival and a done counter per row of tiles), the finalize kernel
    the same tensor and the arrivals a row of tiles completes at (its tiles as
    scheduled)."""
    monkeypatch.setattr(finalize, "EARLY_ROWS", True)
    epi, A, B, tensors = _inputs("lse_target", m, n, 64)
    out = epi(A, B, config=CONFIG, **tensors)
    assert len(rec.gemm) == 1 and len(rec.finalize) == 1
    *_, extras = rec.gemm[0]
    counters = extras[-1]
    assert counters.dtype == torch.int32 and not counters.any()
    assert counters.numel() >= finalize.early_counter_slots(CONFIG, m)
    assert finalize.early_counter_slots(CONFIG, m) == 2 * padded_tiles(m, 128, 2)
    ((written, fin_counters, fm, fn, _, arrivals),) = rec.finalize
    assert fin_counters is counters and (fm, fn) == (m, n)
    assert arrivals == padded_tiles(n, CONFIG.tile_n, CONFIG.cluster_n)
    assert any(out["lse"] is t for t in written)


def test_early_finalize_rule(monkeypatch):
    """On unless turned off; row results only, nothing finalized in the GEMM, 128-row
    tiles, no split-K."""
    monkeypatch.setattr(finalize, "EARLY_ROWS", False)
    assert not finalize.early_rows(EPILOGUES["lse_target"], CONFIG, in_kernel=False)  # off
    monkeypatch.setattr(finalize, "EARLY_ROWS", True)
    rms, dgamma = EPILOGUES["rmsnorm_fwd"], EPILOGUES["dgamma_colsum"]
    assert finalize.early_rows(rms, CONFIG, in_kernel=False)
    assert finalize.early_rows(EPILOGUES["lse_target"], CONFIG, in_kernel=False)
    assert not finalize.early_rows(rms, CONFIG, in_kernel=True)
    assert not finalize.early_rows(dgamma, CONFIG, in_kernel=False)  # column results
    assert not finalize.early_rows(EPILOGUES["swiglu_fwd"], CONFIG, in_kernel=False)
    assert not finalize.early_rows(rms, GemmConfig(tile_m=256), in_kernel=False)
    assert not finalize.early_rows(rms, GemmConfig(split_k=2), in_kernel=False)


def test_partials_come_back_only_when_passed(rec):
    epi, A, B, tensors = _inputs("lse_target", 300, 520, 64)
    assert set(epi(A, B, config=CONFIG, **tensors)) == {"lse", "logit"}
    mine = {
        s.name: torch.empty(s.shape(300, 520, (128, 128)), dtype=s.dtype)
        for s in epi.outputs
        if s.is_partials
    }
    got = epi(A, B, config=CONFIG, outputs=mine, **tensors)
    assert all(got[name] is t for name, t in mine.items())
    assert {"lse", "logit"} <= set(got)


def test_stream_scratch_is_reused_and_fresh_under_capture(rec):
    epi, A, B, tensors = _inputs("lse_target", 300, 520, 64)
    epi(A, B, config=CONFIG, **tensors)
    epi(A, B, config=CONFIG, **tensors)
    first, second = (call[-1] for call in rec.gemm)
    assert first[-1] is second[-1]  # the stream's counters
    assert first[2].data_ptr() == second[2].data_ptr()  # the stream's partials
    rec.capturing["on"] = True
    epi(A, B, config=CONFIG, **tensors)
    captured = rec.gemm[-1][-1]
    assert captured[-1].data_ptr() != first[-1].data_ptr()
    assert captured[2].data_ptr() != first[2].data_ptr()


def test_repeated_calls_skip_the_checks_and_stay_fail_closed(rec, monkeypatch):
    epi, A, B, tensors = _inputs("rmsnorm_fwd", 300, 520, 64)
    full = []
    real = epilogue_kernels._full_checks
    monkeypatch.setattr(epilogue_kernels, "_full_checks", lambda *a: full.append(1) or real(*a))
    slow = []
    real_fast = epilogue_kernels.EpiloguePlan.fast_checks_pass
    monkeypatch.setattr(
        epilogue_kernels.EpiloguePlan,
        "fast_checks_pass",
        lambda self, *a: slow.append(1) or real_fast(self, *a),
    )
    epi(A, B, config=CONFIG, **tensors)
    epi(A, B, config=CONFIG, **tensors)
    assert len(slow) == 1 and not full  # the second call: one look-up, no checks
    # a residual with another row stride (a padded view): a new signature, checked
    wide = torch.zeros(300, 528, dtype=torch.bfloat16)[:, :520]
    wide.copy_(tensors["residual"])
    epi(A, B, config=CONFIG, **{**tensors, "residual": wide})
    assert len(slow) == 2
    # the same signature with a base pointer off TMA's 16 bytes: not trusted, refused
    flat = torch.zeros(300 * 520 + 1, dtype=torch.bfloat16)
    shifted = flat[1:].view(300, 520)
    with pytest.raises(InputError, match="16-byte"):
        epi(A, B, config=CONFIG, **{**tensors, "residual": shifted})
    # a wrong dtype misses the signature cache and is named by the full checks
    with pytest.raises((InputError, TypeError), match="residual"):
        epi(A, B, config=CONFIG, **{**tensors, "residual": tensors["residual"].float()})
    assert full
    # so do a missing name, an extra one and a number in a tensor's place
    missing = {k: v for k, v in tensors.items() if k != "gamma"}
    with pytest.raises((InputError, TypeError), match="gamma"):
        epi(A, B, config=CONFIG, **missing)
    with pytest.raises((InputError, TypeError), match="bogus"):
        epi(A, B, config=CONFIG, **tensors, bogus=tensors["gamma"])
    with pytest.raises((InputError, TypeError), match="residual"):
        epi(A, B, config=CONFIG, **{**tensors, "residual": 1.0})
    assert epilogue_kernels._signature(epi, CONFIG, A, B, missing) is None
    assert epilogue_kernels._signature(epi, CONFIG, A, B, {**tensors, "residual": 1.0}) is None


def test_large_partials_get_a_workspace_per_call(rec, monkeypatch):
    """Partials above ``SCRATCH_MAX_FLOATS`` (an LM head's) are not kept by the stream."""
    monkeypatch.setattr(epilogue_kernels, "SCRATCH_MAX_FLOATS", 16)
    epi, A, B, tensors = _inputs("lse_target", 300, 520, 64)
    epi(A, B, config=CONFIG, **tensors)
    epi(A, B, config=CONFIG, **tensors)
    first, second = (call[-1] for call in rec.gemm)
    assert first[-1] is second[-1]  # the counters are still the stream's
    (scratch,) = epilogue_kernels._scratches.values()
    assert scratch._floats.numel() == 0


def test_non_tensor_operands_get_the_readable_error(rec):
    epi, A, B, tensors = _inputs("rmsnorm_fwd", 300, 520, 64)
    with pytest.raises(TypeError, match="A must be a torch.Tensor"):
        epi(None, B, config=CONFIG, **tensors)


def _shape_of(args):
    """The launch arguments with every tensor as (shape, dtype): comparable across calls."""
    if isinstance(args, tuple):
        return tuple(_shape_of(a) for a in args)
    if isinstance(args, torch.Tensor):
        return (tuple(args.shape), args.dtype)
    return args


@pytest.mark.parametrize("name", sorted(EPILOGUES))
@pytest.mark.parametrize("n", [528, -(-(finalize.ROWS_IN_GEMM_MAX_N + 8) // 16) * 16])
def test_bound_call_launches_what_the_generic_path_does(rec, name, n):
    """The generated straight-line call (``bound_call``) passes the kernel the arguments
    the generic path (caller-supplied outputs) passes, the caller's inputs themselves,
    runs the same finalize and returns the results; its code has no loop."""
    epi, A, B, tensors = _inputs(name, 64, n, 64)
    mine = {s.name: torch.empty(s.shape(64, n, (128, 128)), dtype=s.dtype) for s in epi.outputs}
    generic = epi(A, B, config=CONFIG, outputs=mine, **tensors)
    bound = epi(A, B, config=CONFIG, **tensors)
    (call,) = epilogue_kernels._calls.values()
    assert "for " not in call.__coda_source__ and "while " not in call.__coda_source__
    first, second = rec.gemm
    assert _shape_of(first) == _shape_of(second)
    assert first[0] is second[0] is A and first[1] is second[1] is B
    for a, b in zip(first[3], second[3], strict=True):  # the loads: the caller's tensors
        assert a is b
    for a, b in zip(first[4], second[4], strict=True):  # the extras: inputs, scalars or outputs
        if isinstance(a, torch.Tensor) and any(a is t for t in tensors.values()):
            assert a is b
        elif not isinstance(a, torch.Tensor):
            assert a == b
    (plan,) = epilogue_kernels._plans.values()
    launches = plan.finalizer is not None and plan.finalizer.launch is not None
    assert len(rec.finalize) == (2 if launches else 0)
    if launches:
        assert _shape_of(rec.finalize[0]) == _shape_of(rec.finalize[1])
    assert set(bound) == {s.name for s in epi.outputs if not s.is_partials}
    assert set(bound) <= set(generic)


def test_finalize_lanes_follow_the_size_class_and_size_the_grid():
    """The finalize kernel's threads per row / column result depend on (M, N) only through
    ``size_class``' short rows and short columns (so a launch plan keyed on it is right),
    and its grid covers every row's and column's threads in whole warps."""
    from coda.runtime import finalize
    from coda.testing.catalog import EPILOGUES

    short, long_ = finalize.ROWS_IN_GEMM_MAX_N, finalize.ROWS_IN_GEMM_MAX_N + 1
    assert finalize.lanes(16384, short)[0] == finalize.SHORT_ROW_LANES
    assert finalize.lanes(16384, long_)[0] == finalize.LONG_ROW_LANES
    assert finalize.lanes(finalize.COLS_IN_GEMM_MAX_M, 8)[1] == finalize.SHORT_COL_LANES
    assert finalize.lanes(finalize.COLS_IN_GEMM_MAX_M + 1, 8)[1] == finalize.LONG_COL_LANES
    for lanes in [(32, 8), (16, 16), (2, 32)]:
        rows = finalize.plan(EPILOGUES["lse_target"], lanes=lanes)  # row results only
        assert rows.extent(1000, 2048) == -(-lanes[0] * 1000 // 32) * 32
        cols = finalize.plan(EPILOGUES["dgamma_colsum"], lanes=lanes)  # column results only
        per_warp = 32 // lanes[1]
        assert cols.extent(5000, 2056) == 32 * -(-2056 // per_warp)


def test_kernels_run_only_on_hopper_gpus(monkeypatch):
    """``checks.kernels_run_on``, the fusions' choice between the kernels and their
    reference path: never on the CPU, on a CUDA device only at compute capability 9.0,
    the answer remembered per device."""
    monkeypatch.setattr(checks, "_kernel_devices", {})
    caps = {0: (9, 0), 1: (8, 0)}
    asked = []

    def capability(device=None):
        asked.append(device.index)
        return caps[device.index]

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    assert not checks.kernels_run_on(torch.device("cpu"))
    assert checks.kernels_run_on(torch.device("cuda", 0))
    assert not checks.kernels_run_on(torch.device("cuda", 1))
    assert checks.kernels_run_on(torch.device("cuda", 0))
    assert asked == [0, 1]


def test_the_spill_check_inspects_the_kernel_the_device_launches(monkeypatch):
    """``epilogue_choice`` with a device compiles (for its spill check) the kernel a launch
    there runs, keyed by the grid that fits the device (``occupancy.grid_sms``), not a
    second one keyed by the SM count; without a device it keys by ``num_sms``."""
    from coda.runtime import occupancy

    choose = epilogue_kernels.epilogue_choice
    inspected = []
    monkeypatch.setattr(occupancy, "grid_sms", lambda device, cluster: 120)
    monkeypatch.setattr(
        gemm_kernels, "local_memory_bytes", lambda key: inspected.append(key.num_sms) or 0
    )
    epi = EPILOGUES["rmsnorm_fwd"]
    choose(epi, torch.bfloat16, 4096, 2048, 2048, 132, device=torch.device("cuda", 0))
    choose(epi, torch.bfloat16, 4096, 2048, 2048, 132)
    assert inspected == [120, 132]
