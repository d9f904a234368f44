"""``benchmarks/epilogue_overhead.py --baseline``: rows compared with an earlier result
(CPU, on the committed H200 results)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
overhead = pytest.importorskip("epilogue_overhead")
RESULTS = os.path.join(HERE, "..", "benchmarks", "results")


def _rows(name):
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)["rows"]


#: The table measured with the finalize fixed (engine of a1e657e), kept when the committed
#: epilogue_overhead_h200.json was re-taken on a later engine (2026-11-29).
FIXED_TABLE = "epilogue_overhead_a1e657e_h200.json"


def test_the_rerun_flags_the_log_sum_exp_finalize_regression():
    # the rerun (code faa70e5) against the table measured with the finalize fixed (a1e657e;
    # the table before it, f3c63e1, had the same lse_target rows within a point)
    rows = _rows("epilogue_overhead_rerun_h200.json")
    worse = overhead.against_baseline(rows, _rows(FIXED_TABLE), 0.02)
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


def test_the_table_with_the_fix_has_no_regression_at_2048_against_the_rerun():
    rows = [r for r in _rows(FIXED_TABLE) if r["N"] == 2048]
    worse = overhead.against_baseline(rows, _rows("epilogue_overhead_rerun_h200.json"), 0.02)
    assert worse == []
    lse = [r for r in rows if r["epilogue"] == "lse_target"]
    assert len(lse) == 3 and all(r["baseline_ratio"] - r["ratio"] > 0.02 for r in lse)


def test_replot_draws_the_chart_from_a_written_json_without_a_gpu(tmp_path):
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"device": "test", "rows": _rows("epilogue_overhead_h200.json")}))
    overhead.main(["--replot", str(path)])  # no GPU work: returns after the chart
    png = tmp_path / "table.png"
    has_matplotlib = overhead.common.pyplot() is not None
    assert png.exists() == has_matplotlib


def test_training_epilogues_are_named_beside_the_catalogue():
    epi = overhead.epilogue_named("fusion_swiglu_bwd")
    assert "rzdz" in {s.name for s in epi.outputs}
    assert overhead.epilogue_named("swiglu_bwd") is overhead.EPILOGUES["swiglu_bwd"]
    with pytest.raises(SystemExit, match="unknown epilogue"):
        overhead.epilogue_named("swiglu_bwdd")


def test_the_packed_swiglu_experiment_takes_the_catalogue_swiglu_bwds_tensors():
    """``--epilogues swiglu_bwd_packed_bf16`` times the timeline's experiment under this
    script's protocol: the same inputs and outputs as the catalogue's swiglu_bwd (so one
    set of tensors serves both), a different map."""
    base = overhead.EPILOGUES["swiglu_bwd"]
    for w in ("bf16", "f16"):
        epi = overhead.epilogue_named(f"swiglu_bwd_packed_{w}")
        assert [s.name for s in epi.inputs] == [s.name for s in base.inputs]
        assert [(s.name, s.dtype) for s in epi.outputs] == [(s.name, s.dtype) for s in base.outputs]
        assert epi != base


def test_variant_fields_are_the_committed_tile_rows_fields():
    # --tile-n 192 wrote these fields into epilogue_overhead_tile192_h200.json; the
    # table's columns and the row's fields come from one list
    row = _rows("epilogue_overhead_tile192_h200.json")[0]
    assert set(overhead.variant_columns("tile192")) <= set(row)
    times = {"plain": [2.0, 2.0], "tile": [3.0, 3.0], "tile_plain": [1.5, 1.5]}
    got = overhead.variant_fields("tile192", times, "tile")
    assert list(got) == overhead.variant_columns("tile192")
    assert got["tile192_ms"] == 3.0 and got["tile192_plain_ms"] == 1.5
    assert got["tile192_ratio"] == pytest.approx(1.5)
    assert got["tile192_own_ratio"] == pytest.approx(2.0)


def test_the_rope_experiments_take_the_catalogue_ropes_tensors():
    """``--epilogues rope_fixed_turns,rope_product,...`` (the refuted fixed-point rotary
    angle, results/rope_fixed_turns_*_h200.json) time maps of the catalogue's rope on its
    tensors (``rope_host_turns`` takes two more column vectors); off the GPU each is
    ``ops.rope``."""
    base = overhead.EPILOGUES["rope"]
    names = ["rope_fixed_turns", "rope_product", "rope_bits", "rope_f64_live"]
    for name in [*names, "rope_host_turns"]:
        epi = overhead.epilogue_named(name)
        extra = ["t_lo", "t_hi"] if name == "rope_host_turns" else []
        assert [s.name for s in epi.inputs] == [s.name for s in base.inputs] + extra
        assert [(s.name, s.dtype) for s in epi.outputs] == [(s.name, s.dtype) for s in base.outputs]
    assert overhead.epilogue_named("rope_product") == base
    A, B = torch.randn(24, 32), torch.randn(16, 32)
    pos, freq = torch.arange(24.0), torch.rand(8)
    want = base.reference(A, B, pos=pos, freq=freq)["y"]
    for name in names:
        got = overhead.epilogue_named(name).reference(A, B, pos=pos, freq=freq)["y"]
        torch.testing.assert_close(got, want)


@pytest.mark.compile
def test_the_rope_experiments_kernels_are_what_their_note_says(tmp_path):
    """The fixed-point angle takes rope's FP32-pipe instructions from 12 to 7 a rotary
    pair (768 -> 452 a thread and tile) and brings fp64 (``DMUL``) and 64-bit conversions
    in; with T handed in no fp64 is left; ``rope_f64_live`` is the catalogue's rope plus
    the fp64 part alone."""
    from coda.mainloop.config import GemmConfig
    from coda.runtime import gemm_kernels
    from coda.runtime.fused import FusedVisitor
    from coda.runtime.sass import (
        count_prefix,
        disassemble,
        find_nvdisasm,
        fp32_pipe_count,
        opcode_counts,
    )

    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed")

    def counts(name):
        key = gemm_kernels.GemmKernelKey(
            GemmConfig(tile_n=128, cluster_m=2),
            torch.bfloat16,
            FusedVisitor(overhead.epilogue_named(name)),
        )
        _, cubin = gemm_kernels.compile_artifacts(key, str(tmp_path / name))
        return opcode_counts(disassemble(cubin))

    base, fixed = counts("rope"), counts("rope_fixed_turns")
    host, f64 = counts("rope_host_turns"), counts("rope_f64_live")
    assert fp32_pipe_count(base) == 768 and fp32_pipe_count(fixed) == 452
    assert fp32_pipe_count(host) == 452 and fp32_pipe_count(f64) == 768 + 16
    assert count_prefix(base, "DMUL") == 0 and count_prefix(host, "DMUL") == 0
    assert count_prefix(fixed, "DMUL") == count_prefix(f64, "DMUL") == 32
    assert count_prefix(fixed, "IMAD.WIDE.U32") == count_prefix(host, "IMAD.WIDE.U32") == 64
