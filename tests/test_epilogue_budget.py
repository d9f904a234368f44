"""``benchmarks/epilogue_budget.py``: the split of a fused epilogue's extra time into the
mainloop's slowdown, the exposed epilogues and the clock, on synthetic timeline rows whose
spans are built from those terms (CPU)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
budget_mod = pytest.importorskip("epilogue_budget")

TILES = 16


def _row(variant, mainloop, epilogue, mhz, exposed=0.0, start=300.0, n=2048):
    """A timeline row whose span is start-up + tiles mainloops + waits + last epilogue."""
    span = (start + TILES * mainloop + epilogue) / (1.0 - exposed)
    return {
        "variant": variant,
        "N": n,
        "K": n,
        "tiles": TILES,
        "mainloop": mainloop,
        "epilogue": epilogue,
        "exposed_frac": exposed,
        "span": span,
        "mhz": mhz,
        "kernel_us": span / mhz,
    }


def test_shares_add_up_to_the_span_and_the_clock_to_the_kernel_ratio():
    plain = _row("store_acc", 1000.0, 200.0, 1500.0)
    fused = _row("heavy", 1100.0, 700.0, 1400.0)
    b = budget_mod.budget(fused, plain)
    span_p = plain["span"]
    assert b["mainloop_share"] == pytest.approx(TILES * 100.0 / span_p)
    assert b["last_epilogue_share"] == pytest.approx(500.0 / span_p)
    assert b["steady_exposed_share"] == pytest.approx(0.0)
    assert b["rest_share"] == pytest.approx(0.0, abs=1e-12)  # the span is exactly these terms
    assert b["clock_ratio"] == pytest.approx(1500.0 / 1400.0)
    assert b["kernel_ratio"] == pytest.approx(b["span_ratio"] * b["clock_ratio"])
    # what-ifs: each removes its term and keeps the clock
    no_last = (300.0 + TILES * 1100.0 + 200.0) / span_p * 1500.0 / 1400.0
    assert b["ratio_last_hidden"] == pytest.approx(no_last)
    half_last = (300.0 + TILES * 1100.0 + 450.0) / span_p * 1500.0 / 1400.0
    assert b["ratio_last_halved"] == pytest.approx(half_last)
    unslowed = (300.0 + TILES * 1000.0 + 700.0) / span_p * 1500.0 / 1400.0
    assert b["ratio_mainloop_unslowed"] == pytest.approx(unslowed)
    assert b["ratio_same_clock"] == pytest.approx(b["span_ratio"])


def test_the_gemm_kernels_clock_and_the_finalize_tail_are_separate_terms():
    plain = _row("store_acc", 1000.0, 200.0, 1500.0)
    fused = _row("reducing", 1100.0, 700.0, 1400.0)
    for row, tail in ((plain, 1.0), (fused, 4.0)):  # us after the GEMM kernel
        row["gemm_us"] = row["span"] / row["mhz"]
        row["tail_us"] = tail
        row["sm_mhz"] = row["mhz"]
        row["kernel_us"] = row["gemm_us"] + tail
        row["mhz"] = row["span"] / row["kernel_us"]  # the call's time: tail folded in
    b = budget_mod.budget(fused, plain)
    assert b["clock_ratio"] == pytest.approx(1500.0 / 1400.0)
    assert b["tail_share"] == pytest.approx(3.0 / plain["gemm_us"])
    model = b["span_ratio"] * b["clock_ratio"] + b["tail_share"]
    assert b["model_ratio"] == pytest.approx(model)
    assert b["ratio_no_tail"] == pytest.approx(b["span_ratio"] * b["clock_ratio"])
    assert b["ratio_same_clock"] == pytest.approx(b["span_ratio"] + b["tail_share"])
    no_last = (b["span_ratio"] - b["last_epilogue_share"]) * b["clock_ratio"] + b["tail_share"]
    assert b["ratio_last_hidden"] == pytest.approx(no_last)
    # the call's own ratio agrees with the model up to the tail's denominator
    assert b["kernel_ratio"] == pytest.approx(model, rel=3.0 / plain["gemm_us"])


def test_waiting_tensor_cores_count_as_steady_exposure():
    plain = _row("store_acc", 1000.0, 200.0, 1500.0)
    fused = _row("long", 1000.0, 1200.0, 1500.0, exposed=0.05)
    b = budget_mod.budget(fused, plain)
    assert b["steady_exposed_share"] == pytest.approx(0.05 * fused["span"] / plain["span"])
    assert b["mainloop_share"] == pytest.approx(0.0)
    total = b["mainloop_share"] + b["steady_exposed_share"] + b["last_epilogue_share"]
    assert 1.0 + total + b["rest_share"] == pytest.approx(b["span_ratio"])


def test_runs_combine_as_medians_with_the_item4_ratios_beside():
    runs = [
        [_row("store_acc", 1000.0, 200.0, 1500.0), _row("epi", 1000.0 + d, 400.0, 1500.0)]
        for d in (10.0, 50.0, 20.0)
    ]
    table = [
        {"epilogue": "epi", "layout": "fwd", "N": 2048, "K": 2048, "ratio": 1.07},
        {"epilogue": "epi", "layout": "wgrad", "N": 2048, "K": 2048, "ratio": 1.05},
        {"epilogue": "epi", "layout": "fwd", "N": 4096, "K": 4096, "ratio": 1.01},
        {"epilogue": "other", "layout": "fwd", "N": 2048, "K": 2048, "ratio": 1.5},
    ]
    (row,) = budget_mod.combine(runs, table)
    assert (row["epilogue"], row["N"], row["K"], row["runs"]) == ("epi", 2048, 2048, 3)
    span_p = runs[0][0]["span"]
    assert row["mainloop_share"] == pytest.approx(TILES * 20.0 / span_p)  # the median run
    assert row["item4_ratios"] == {"fwd": 1.07, "wgrad": 1.05}


def test_a_timeline_without_its_plain_row_or_at_another_shape_is_refused():
    with pytest.raises(ValueError, match="store_acc"):
        budget_mod.combine([[_row("epi", 1000.0, 400.0, 1500.0)]], [])
    mixed = [_row("store_acc", 1000.0, 200.0, 1500.0), _row("epi", 1.0, 1.0, 1.0, n=4096)]
    with pytest.raises(ValueError, match="N, K"):
        budget_mod.combine([mixed], [])
