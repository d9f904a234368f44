"""``benchmarks/epilogue_overhead.py --baseline``: rows compared with an earlier result
(CPU, on the committed H200 results)."""

from __future__ import annotations

import json
import os
import sys

import pytest

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
overhead = pytest.importorskip("epilogue_overhead")
RESULTS = os.path.join(HERE, "..", "benchmarks", "results")


def _rows(name):
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)["rows"]


def test_the_rerun_flags_the_log_sum_exp_finalize_regression():
    rows = _rows("epilogue_overhead_rerun_h200.json")
    worse = overhead.against_baseline(rows, _rows("epilogue_overhead_h200.json"), 0.02)
    flagged = {(r["epilogue"], r["layout"], r["N"]) for r in worse}
    # the finalize kernel's rounds of 16 loads: lse_target at N = K = 2048, every layout
    assert {("lse_target", layout, 2048) for layout in ("fwd", "dgrad", "wgrad")} <= flagged
    assert all(r["ratio"] - r["baseline_ratio"] > 0.02 for r in worse)
    ratios = [r["ratio"] - r["baseline_ratio"] for r in worse]
    assert ratios == sorted(ratios, reverse=True)
    assert all(r["baseline_ratio"] is not None for r in rows)  # every row had a twin


def test_rows_without_a_twin_get_none_and_are_not_flagged():
    row = {"epilogue": "x", "layout": "fwd", "M": 1, "N": 2, "K": 2, "ratio": 9.0}
    same = dict(row, ratio=1.0)
    assert overhead.against_baseline([row], [], 0.02) == [] and row["baseline_ratio"] is None
    assert overhead.against_baseline([row], [same], 0.02) == [row]
    assert row["baseline_ratio"] == 1.0
    # within the tolerance: not a regression
    assert overhead.against_baseline([dict(row, ratio=1.01)], [same], 0.02) == []
