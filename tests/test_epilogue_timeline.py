"""``benchmarks/epilogue_timeline.py``'s reading of per-tile clock records (CPU, synthetic
PingPong timelines with a known answer)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
timeline = pytest.importorskip("epilogue_timeline")

TILE_M = 16  # rows per tile: room for the 6 fields and the 3 wait fields


def _records(mainloop: int, epilogue: int, tiles: int, sm: int = 3, origin: int = 0, waits=None):
    """A PingPong SM: warpgroups 0 and 1 alternate on the tensor cores; each is ready for
    its next mainloop when its epilogue ends, and a mainloop starts when the previous one
    ended and its warpgroup is ready. Returns the Timeline partials (M, tiles_n)."""
    wrap = 1 << timeline.CLOCK_BITS
    recs, end_prev, ready = [], 0, [0, 0]
    for i in range(tiles):
        wg = i % 2
        start = max(end_prev, ready[wg])
        end = start + mainloop
        epi0, epi1 = end + 10, end + 10 + epilogue
        rec = [(c + origin) % wrap for c in (ready[wg], end, epi0, epi1)] + [sm, wg]
        recs.append(rec + (list(waits(i)) if waits else []))
        ready[wg], end_prev = epi1, end
    cols = 4
    out = torch.zeros(TILE_M * -(-tiles // cols), cols)
    for i, r in enumerate(recs):
        tm, tn = divmod(i, cols)
        out[tm * TILE_M : tm * TILE_M + len(r), tn] = torch.tensor(r, dtype=torch.float64)
    return out


def test_hidden_epilogue_leaves_the_tensor_cores_busy():
    s = timeline.analyse(_records(mainloop=1000, epilogue=600, tiles=12), TILE_M)
    assert s["mainloop"] == 1000 and s["exposed_frac"] == 0 and s["late_frac"] == 0
    assert s["epilogue"] == 600 and s["epi_wait"] == 10 and s["tiles"] == 12
    assert s["sample"]["sm"] == 3 and len(s["sample"]["records"]) == 12


def test_long_epilogue_is_exposed():
    # each warpgroup's epilogue (10 + 1500) outlasts the other's mainloop (1000): a pair
    # of tiles takes 1000 + 1510 cycles, the tensor cores idle 510 of them, waiting for
    # one of the two warpgroups (the other is just in time)
    s = timeline.analyse(_records(mainloop=1000, epilogue=1500, tiles=12), TILE_M)
    assert s["mainloop"] == 1000 and s["late_frac"] == 0.5
    # 10 hand-overs counted (the first two tiles are start-up), every other one late
    assert s["exposed_frac"] == pytest.approx(5 * 510 / s["span"])
    assert s["period"] == pytest.approx(2510 / 2, rel=0.1)


def test_clocks_that_wrap_24_bits_read_the_same():
    plain = timeline.analyse(_records(1000, 1500, 12), TILE_M)
    wrapped = timeline.analyse(_records(1000, 1500, 12, origin=(1 << 24) - 5000), TILE_M)
    for key in ("mainloop", "exposed_frac", "late_frac", "epilogue", "span"):
        assert wrapped[key] == pytest.approx(plain[key])


def test_wait_fields_are_the_steady_tiles_medians():
    # tile i's k-loop waits (stage, issue, WGMMA): the first two tiles (start-up) are
    # outliers that the medians leave out
    def waits(i):
        return (9000, 9000, 9000) if i < 2 else (300 + i % 2, 700, 40)

    s = timeline.analyse(_records(1000, 600, 12, waits=waits), TILE_M, waits=True)
    assert s["stage_wait"] == pytest.approx(300.5) and s["mma_issue"] == 700
    assert s["mma_wait"] == 40 and s["mainloop"] == 1000
    assert "stage_wait" not in timeline.analyse(_records(1000, 600, 12), TILE_M)


def test_packed_probes_compute_what_their_fp32_twins_do():
    # off the GPU the packed probes are their fp32 chains and the packed SwiGLU backward
    # is the catalogue's (they are timing experiments; their kernels round to 16 bits)
    from coda.testing.catalog import EPILOGUES

    probes = timeline.probes()
    A, B = torch.randn(24, 16), torch.randn(40, 16)
    fp32 = probes["fma16"].reference(A, B)["r"]
    for name in ("hfma16_bf16", "hfma16_f16"):
        torch.testing.assert_close(probes[name].reference(A, B)["r"], fp32)
    gu = torch.randn(24, 80).to(torch.bfloat16)
    want = EPILOGUES["swiglu_bwd"].reference(A, B, gu=gu)
    for name in ("swiglu_bwd_packed_bf16", "swiglu_bwd_packed_f16"):
        got = probes[name].reference(A, B, gu=gu)
        torch.testing.assert_close(got["dgu"], want["dgu"])
        torch.testing.assert_close(got["zdz"], want["zdz"])


@pytest.mark.compile
def test_hfma32_has_fma16s_instruction_count_in_packed_pairs(tmp_path):
    from coda.runtime import gemm_kernels
    from coda.runtime.epilogue_kernels import epilogue_choice
    from coda.runtime.fused import FusedVisitor
    from coda.runtime.sass import disassemble, find_nvdisasm, opcode_counts

    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed")
    epi = timeline.probes()["hfma32_bf16"]
    bf16 = torch.bfloat16
    cfg = epilogue_choice(epi, bf16, 4096, 2048, 2048, num_sms=132, majors=("k", "k"))[0]
    key = gemm_kernels.GemmKernelKey(cfg, bf16, FusedVisitor(epi), 132, "k", "k")
    _, cubin = gemm_kernels.compile_artifacts(key, str(tmp_path))
    ops = opcode_counts(disassemble(cubin))
    # 32 packed FMAs per pair x 64 pairs per thread: fma16's 16 x 128 FFMA, as pairs
    assert ops["HFMA2.BF16_V2"] == 32 * 64
    assert ops.get("FFMA", 0) == 0


def _probe_kernel(name: str, tmp_path):
    """(opcode counts, the config) of a probe's kernel in the config coda picks for it,
    compiled here for sm_90a."""
    from coda.runtime import gemm_kernels
    from coda.runtime.epilogue_kernels import epilogue_choice
    from coda.runtime.fused import FusedVisitor
    from coda.runtime.sass import disassemble, find_nvdisasm, opcode_counts

    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed")
    epi = timeline.probes()[name]
    bf16 = torch.bfloat16
    cfg = epilogue_choice(epi, bf16, 4096, 2048, 2048, num_sms=132, majors=("k", "k"))[0]
    key = gemm_kernels.GemmKernelKey(cfg, bf16, FusedVisitor(epi), 132, "k", "k")
    _, cubin = gemm_kernels.compile_artifacts(key, str(tmp_path))
    return opcode_counts(disassemble(cubin)), cfg


def _elements(cfg) -> int:
    """acc elements a thread holds per tile (a PingPong warpgroup's 128 threads)."""
    return cfg.warpgroup_config.tile_m * cfg.tile_n // 128


def _base_opcodes(ops: dict[str, int]) -> dict[str, int]:
    """Counts by opcode without its modifiers."""
    base: dict[str, int] = {}
    for op, n in ops.items():
        base[op.split(".")[0]] = base.get(op.split(".")[0], 0) + n
    return base


#: probe -> the opcodes its 16 steps per element become (at least 16 per element of a
#: thread); none of them may run its chain as FFMAs
PIPE_PROBES = {"dfma16": ("DFMA",), "imad16": ("IMAD",), "lop16": ("LOP3", "SHF")}


@pytest.mark.compile
@pytest.mark.parametrize("name", sorted(PIPE_PROBES))
def test_pipe_probes_run_their_chains_off_the_fp32_pipe(name, tmp_path):
    # epilogue_timeline_pipes_h200.json reads each probe's cost per instruction beside the
    # k-loop: that needs the chain to be the instructions named, not FFMAs
    raw, cfg = _probe_kernel(name, tmp_path)
    ops = _base_opcodes(raw)
    assert sum(ops.get(op, 0) for op in PIPE_PROBES[name]) >= 16 * _elements(cfg)
    assert ops.get("FFMA", 0) == 0


@pytest.mark.compile
def test_paced_probe_keeps_fma16s_ffmas_and_sleeps_between_elements(tmp_path):
    # epilogue_timeline_paced_h200.json compares it with fma16: the same FFMAs, spread
    raw, cfg = _probe_kernel("fma16_paced20", tmp_path)
    elements = _elements(cfg)
    per_subtile = cfg.epi_m * cfg.epi_n // 128  # the elements of one call of the probe
    assert _base_opcodes(raw)["FFMA"] == 16 * elements
    # a plain NANOSLEEP (the pipeline's waits are NANOSLEEP.SYNCS) before each element's
    # chain but the first of each subtile
    assert raw["NANOSLEEP"] == elements - elements // per_subtile


@pytest.mark.compile
def test_conversion_probes_convert_every_step(tmp_path):
    # epilogue_timeline_cvt_h200.json reads the cost of a 16-bit store's conversion from
    # cvtpack16 (packed, two elements an instruction) beside fma16, and cvt16 (unpacked)
    for name, op, per_element in (
        ("cvtpack16", "F2FP.BF16.F32.PACK_AB", 8),
        ("cvt16", "F2F.BF16.F32", 16),
    ):
        raw, cfg = _probe_kernel(name, tmp_path / name)
        assert raw[op] == per_element * _elements(cfg)
        assert _base_opcodes(raw)["FFMA"] == 16 * _elements(cfg)


def test_conversion_probes_round_like_torch():
    # off the GPU both are fma16's chain rounded to bf16 at every step
    probes = timeline.probes()
    A, B = torch.randn(24, 16), torch.randn(40, 16)
    x = A @ B.T
    y = x
    for _ in range(16):
        y = (y * 0.999 + x).to(torch.bfloat16).float()
    for name in ("cvt16", "cvtpack16"):
        torch.testing.assert_close(
            probes[name].reference(A, B)["r"], y.sum(1), rtol=1e-5, atol=1e-4
        )


#: probe -> the instructions each of its 16 steps per element must bring (the
#: conversion-and-wide-integer probes of epilogue_timeline_cvt_h200.json's second call)
STEP_PROBES = {
    "i2f16": ("F2I.TRUNC.NTZ", "I2FP.F32.S32", "FFMA"),
    "cvt64_16": ("F2I.S64.TRUNC", "I2F.S64", "FFMA"),
    "f64cvt16": ("F2F.F64.F32", "DMUL", "F2F.F32.F64", "FFMA"),
    "imadwide16": ("IMAD.WIDE.U32",),
}


@pytest.mark.compile
@pytest.mark.parametrize("name", sorted(STEP_PROBES))
def test_step_probes_bring_their_instructions_every_step(name, tmp_path):
    raw, cfg = _probe_kernel(name, tmp_path)
    for op in STEP_PROBES[name]:
        assert raw.get(op, 0) >= 16 * _elements(cfg), (op, raw.get(op, 0))
    if name == "imadwide16":  # the chain is integer: no FFMA runs it
        assert raw.get("FFMA", 0) == 0
