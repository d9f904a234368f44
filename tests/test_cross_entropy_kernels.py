"""CPU CI for the cross-entropy kernels: the epilogues ``linear_cross_entropy`` runs
(``coda.fusions.ce_epilogues``, incl. the new ``OneHot`` primitive) trace into the
PingPong GEMM and compile for sm_90a; in the config ``epi(A, B)`` picks for them
(``epilogue_choice``: 128 x 128 tiles unless those spill) the SASS runs the GEMM on HGMMA
with no local memory (LDL/STL), and the default loss's kernels keep 128 x 128 tiles (on
both paths: recompute, and gradient-in-forward with its stored acc, map pass, and the last
row chunk's dW GEMM on transposed operands adding the fp32 sum of the other chunks; and
the shifted softmax's store, map and row-scaled dh kernels, and its row-scaled h map pass;
per-row losses' dbias map pass; the entropy beside the statistics of both paths).
"""

from __future__ import annotations

import pytest
import torch

from coda import Elementwise, Epilogue, TileReduce, TileStore, ops
from coda.fusions._dispatch import MAP_K
from coda.fusions.ce_epilogues import (
    grad_epilogue,
    grad_map_epilogue,
    row_scaled_epilogue,
    scaled_total_epilogue,
    shifted_map_epilogue,
    shifted_store_epilogue,
    stats_epilogue,
    stats_map_epilogue,
    stats_store_epilogue,
    weighted_colsum_epilogue,
)
from coda.primitives import OneHot
from coda.runtime import gemm_kernels
from coda.runtime.epilogue_kernels import epilogue_choice
from coda.runtime.fused import FusedVisitor, unsupported
from coda.runtime.sass import count_prefix, disassemble, find_nvdisasm, opcode_counts

pytestmark = pytest.mark.compile
bf16 = torch.bfloat16

# name -> (epilogue, must keep 128-wide tiles[, (M, N, K) of its GEMM[, majors of A, B]])
MNK = (16384, 8192, 4096)
KERNELS = {
    # the default loss: forward statistics, backward dlogits
    "stats": (stats_epilogue(None, False, None, False, False), True),
    "grad": (grad_epilogue(bf16, None, False, None, False, False, False), True),
    # the deferred final RMSNorm: rstd row scale in both, drstd row sums in the backward
    "grad_rstd": (grad_epilogue(bf16, None, True, None, False, False, True), True),
    # the V mod 8 tail of the forward (masked log-sum-exp), with softcap and smoothing
    "stats_tail_softcap_sum": (stats_epilogue(None, False, 30.0, True, True), False),
    # the gradient-in-forward path: statistics + the acc stored (rounded to bf16 first), and
    # the acc-free map pass over it (K = MAP_K zero GEMM), default loss and every option
    "stats_store": (stats_store_epilogue(bf16, None, False, None, False), True),
    "grad_map": (
        grad_map_epilogue(bf16, bf16, None, False, None, False, False, False),
        True,
        (16384, 8192, MAP_K),
    ),
    "grad_map_all": (
        grad_map_epilogue(bf16, bf16, bf16, True, 30.0, True, True, True),
        False,
        (16384, 8192, MAP_K),
    ),
    # ``ce_fused.STATS_PASS = "map"``: the statistics from a map pass over the acc a plain
    # GEMM stored, default loss and every forward option
    "stats_map": (
        stats_map_epilogue(bf16, None, False, None, False),
        True,
        (16384, 8192, MAP_K),
    ),
    "stats_map_all": (
        stats_map_epilogue(bf16, bf16, True, 30.0, True),
        False,
        (16384, 8192, MAP_K),
    ),
    # the fp32 stored acc (``ACC_STORE_DTYPE``): its 8 KiB subtile loads still fit the
    # concurrent epilogues' two-tile load ring
    "grad_map_all_acc32": (
        grad_map_epilogue(torch.float32, bf16, bf16, True, 30.0, True, True, True),
        False,
        (16384, 8192, MAP_K),
    ),
    # the backward's last row chunk: dW = g * (dlogits.T @ h_c + the fp32 sum of the other
    # chunks) in bf16, V' x H x rows (Llama 3, H = 2048, 2048 rows), A = dl.t() and
    # B = h_c.t(); and its dh = g * dlogits @ W[:V'], rows x H x V' (B = W.t())
    "scaled_sum_dW": (
        scaled_total_epilogue(bf16, True),
        True,
        (128256, 2048, 2048),
        ("m", "n"),
    ),
    "scaled_dh": (scaled_total_epilogue(bf16, False), True, (2048, 2048, 128256), ("k", "n")),
    # the shifted softmax (``ce_fused.GRAD_PASS``): the logits GEMM storing R = exp(z - c)
    # beside lse and zt (with the deferred RMSNorm's rstd too), its map variant over a
    # stored acc, and dh = g * (sr * R @ W[:V'] + the tail's fp32 part)
    "shifted_store": (shifted_store_epilogue(bf16, False), True),
    "shifted_store_rstd": (shifted_store_epilogue(bf16, True), True),
    "shifted_store_softcap": (shifted_store_epilogue(bf16, True, 30.0), True),
    # label smoothing: the row sums of z beside lse and zt; dh / dW with rank-1 terms
    "shifted_store_sum": (shifted_store_epilogue(bf16, True, None, True), True),
    "shifted_map": (shifted_map_epilogue(bf16, bf16, True), True, (16384, 8192, MAP_K)),
    "row_scaled_dh": (
        scaled_total_epilogue(bf16, True, True),
        True,
        (2048, 2048, 128256),
        ("k", "n"),
    ),
    "row_scaled_rank1_dh": (
        scaled_total_epilogue(bf16, True, True, True),
        True,
        (2048, 2048, 128256),
        ("k", "n"),
    ),
    "rank1_sum_dW": (
        scaled_total_epilogue(bf16, True, False, True),
        True,
        (128256, 2048, 2048),
        ("m", "n"),
    ),
    # the dW GEMM's operand sr * h of a row chunk (2048 x H): a map pass
    "row_scaled_map": (row_scaled_epilogue(bf16), True, (2048, 4096, MAP_K)),
    # per-row losses with a bias: dbias, the stored dlogits' g-weighted column sums
    "weighted_colsum_map": (weighted_colsum_epilogue(bf16), True, (8192, 128256, MAP_K)),
    # ``return_entropy`` (recompute path): SoftmaxEntropy beside lse and zt, on the V mod 8
    # tail with softcap too; the gradient with the entropy's term (and every option)
    "stats_entropy": (stats_epilogue(None, False, None, False, False, True), True),
    "stats_entropy_all": (stats_epilogue(bf16, True, 30.0, True, False, True), True),
    "stats_entropy_tail_softcap": (stats_epilogue(None, False, 30.0, False, True, True), False),
    "grad_entropy": (grad_epilogue(bf16, None, False, None, False, False, False, True), False),
    "grad_entropy_all": (grad_epilogue(bf16, bf16, True, 30.0, True, True, True, True), False),
    # ``return_entropy="detached"`` on the gradient-in-forward path: SoftmaxEntropy in
    # place of LogSumExp in the statistics of each of its forward kernels
    "shifted_store_entropy": (shifted_store_epilogue(bf16, False, None, False, True), True),
    "shifted_store_entropy_rstd_sum": (
        shifted_store_epilogue(bf16, True, None, True, True),
        True,
    ),
    "shifted_store_entropy_softcap": (
        shifted_store_epilogue(bf16, True, 30.0, False, True),
        True,
    ),
    "shifted_map_entropy": (
        shifted_map_epilogue(bf16, bf16, True, None, False, True),
        True,
        (16384, 8192, MAP_K),
    ),
    "stats_store_entropy": (stats_store_epilogue(bf16, None, False, None, False, True), True),
    "stats_map_entropy_all": (
        stats_map_epilogue(bf16, bf16, True, 30.0, True, True),
        False,
        (16384, 8192, MAP_K),
    ),
    # OneHot at width 1/2 (pairs across lanes) feeding a row and a column reduction
    "onehot_half": (
        Epilogue().add(
            OneHot("hot", target="t", target_dtype=torch.int32, width="1/2"),
            Elementwise("y", ops.swiglu, pairwise="reduce"),
            Elementwise("p", ops.mul, ins=("y", "hot")),
            TileReduce("picked", of="p", op="sum"),
            TileStore("hot", bf16),
        ),
        False,
    ),
}


@pytest.mark.parametrize("name", list(KERNELS))
def test_cross_entropy_kernels_compile_without_spills(name, tmp_path):
    epi, wide, *rest = KERNELS[name]
    mnk = rest[0] if rest else MNK
    majors = rest[1] if len(rest) > 1 else ("k", "k")
    assert unsupported(epi) is None
    cfg = epilogue_choice(epi, bf16, *mnk, num_sms=132, majors=majors)[0]
    if wide:
        assert cfg.tile_n == 128, cfg
    key = gemm_kernels.GemmKernelKey(cfg, bf16, FusedVisitor(epi), 132, *majors)
    ptx, cubin = gemm_kernels.compile_artifacts(key, str(tmp_path))
    # the map passes (epilogues that never read acc) run no mainloop
    reads_acc = FusedVisitor(epi).reads_acc
    assert ("wgmma.mma_async" in ptx) == reads_acc and len(cubin) > 0
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed")
    opcodes = opcode_counts(disassemble(cubin))
    assert (count_prefix(opcodes, "HGMMA") > 0) == reads_acc
    assert count_prefix(opcodes, "LDL") == 0 and count_prefix(opcodes, "STL") == 0, "spills"


def test_gradient_map_loads_its_row_vectors_once_per_band(tmp_path):
    """The gradient map pass's row vectors (lse, the coefficients) and OneHot's targets
    are loaded once per band of subtiles (``TraceSubtile.per_band``): 16 global loads in
    the kernel where per-subtile loads made 64."""
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed")
    epi, _, mnk = KERNELS["grad_map"]
    cfg = epilogue_choice(epi, bf16, *mnk, num_sms=132)[0]
    key = gemm_kernels.GemmKernelKey(cfg, bf16, FusedVisitor(epi), 132, "k", "k")
    _, cubin = gemm_kernels.compile_artifacts(key, str(tmp_path))
    opcodes = opcode_counts(disassemble(cubin))
    assert count_prefix(opcodes, "LDG") <= 16, opcodes


@pytest.mark.parametrize(
    "partial, mnk, majors",
    [
        (False, (8192, 8192, 128256), ("k", "n")),  # dh = g * dl @ W[:V'] (one chunk)
        (False, (128256, 8192, 8192), ("m", "n")),  # dW = g * dl.T @ h (one chunk)
        (True, (128256, 4096, 16384), ("m", "n")),  # dW with the earlier chunks' fp32 sum
    ],
    ids=["dh", "dW", "dW_sum"],
)
def test_backward_gemms_take_the_plain_gemm_tile(partial, mnk, majors):
    """The cross-entropy backward's GEMMs run ``config="gemm"`` (``ce_fused.BACKWARD_TILES``):
    the plain heuristic's tile, here a 256-row cooperative one (both warpgroups store
    their scaled halves at once), and that kernel does not spill (``epilogue_choice``
    keeps it)."""
    from coda.fusions import ce_fused
    from coda.mainloop.config import choose_config
    from coda.runtime.epilogue_kernels import gemm_tiles

    assert ce_fused.BACKWARD_TILES == "gemm"
    plain = choose_config(*mnk, 132)
    assert plain.cooperative and plain.tile_n >= 128, plain
    epi = scaled_total_epilogue(bf16, partial)
    base = gemm_tiles(*mnk, 132)
    assert base == plain
    cfg, _ = epilogue_choice(epi, bf16, *mnk, num_sms=132, majors=majors, base=base)
    assert cfg == base


def test_chunk_dw_gemm_compiles_on_its_tile(tmp_path):
    """The row chunks' dW GEMM (``ce_fused.CHUNK_DW_TILES``: dlogits.T @ h_c, A M-major,
    B N-major, fp32 reduce-add into the dW sum) compiles on its 128 x 160 tile: HGMMA
    64 x 160, TMA reduce-add stores only, no local memory."""
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    from coda.fusions import ce_fused
    from coda.mainloop.visitor import AccStore

    cfg = ce_fused.CHUNK_DW_TILES
    assert (cfg.tile_m, cfg.tile_n, cfg.cluster_m, cfg.cluster_n) == (128, 160, 2, 1)
    key = gemm_kernels.GemmKernelKey(
        cfg, bf16, AccStore(torch.float32, True), a_major="m", b_major="n"
    )
    ptx, cubin = gemm_kernels.compile_artifacts(key, str(tmp_path))
    ops = opcode_counts(disassemble(cubin))
    assert ops["HGMMA.64x160x16.F32.BF16"] > 0, [o for o in ops if o.startswith("HGMMA")]
    assert count_prefix(ops, "UTMAREDG") > 0 and count_prefix(ops, "UTMASTG") == 0
    assert count_prefix(ops, "LDL") == 0 and count_prefix(ops, "STL") == 0


@pytest.mark.parametrize(
    "flags",
    [None, (False, True, False), (True, True, True)],
    ids=["map_path_plain", "shifted_row_scale", "shifted_tail_smoothing"],
)
def test_chunk_dh_gemm_compiles_on_its_tile(flags, tmp_path):
    """The row chunks' dh GEMM in the forward (``ce_fused.CHUNK_DH_TILES``: dlogits @
    W[:V'], A K-major, B = W.t() N-major), run on that config as given (no spill check
    narrows an explicit config): the map path's plain bf16 store, and the shifted path's
    ``scaled_total_epilogue`` with the row factor, alone and with the V mod 8 tail's fp32
    partial and label smoothing's rank-1 term (the most registers). Cooperative 256 x 128
    (HGMMA 64 x 128), no local memory."""
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    from coda.fusions import ce_fused
    from coda.mainloop.visitor import AccStore

    cfg = ce_fused.CHUNK_DH_TILES
    assert cfg.cooperative and (cfg.tile_m, cfg.tile_n) == (256, 128), cfg
    if flags is None:
        visitor = AccStore(bf16)
    else:
        partial, row_scale, rank1 = flags
        visitor = FusedVisitor(scaled_total_epilogue(bf16, partial, row_scale, rank1))
    key = gemm_kernels.GemmKernelKey(cfg, bf16, visitor, 132, "k", "n")
    _, cubin = gemm_kernels.compile_artifacts(key, str(tmp_path))
    ops = opcode_counts(disassemble(cubin))
    assert ops["HGMMA.64x128x16.F32.BF16"] > 0, [o for o in ops if o.startswith("HGMMA")]
    assert count_prefix(ops, "LDL") == 0 and count_prefix(ops, "STL") == 0


@pytest.mark.parametrize("lanes", [None, "in_gemm"])
def test_entropy_finalize_compiles(lanes, tmp_path):
    """``SoftmaxEntropy``'s finalize (``tracing.finalize_entropy``: the tiles' (max, sum,
    weighted sum) triples merged, then across the row's lanes by shuffles) compiles in the
    finalize kernel at every lane count it may run with, and inside the GEMM kernel (one
    thread a row): no local memory."""
    from coda.runtime import finalize

    epi = KERNELS["stats_entropy"][0]
    if lanes == "in_gemm":
        cfg = epilogue_choice(epi, bf16, *MNK, num_sms=132)[0]
        key = gemm_kernels.GemmKernelKey(cfg, bf16, FusedVisitor(epi, True), 132, "k", "k")
        ptx, cubin = gemm_kernels.compile_artifacts(key, str(tmp_path))
        assert "atom.global.add.u32" in ptx
        builds = [cubin]
    else:
        counts = sorted({finalize.lanes(m, n) for m in (1, 10**6) for n in (1, 10**6)})
        builds = []
        for i, n in enumerate(counts):
            (tmp_path / str(i)).mkdir()
            ptx, cubin = finalize.compile_artifacts(epi, str(tmp_path / str(i)), n)
            assert ("shfl.sync.bfly" in ptx) == (n[0] > 1), n  # the row lanes' merge
            builds.append(cubin)
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed")
    for cubin in builds:
        ops = opcode_counts(disassemble(cubin))
        assert count_prefix(ops, "LDL") == 0 and count_prefix(ops, "STL") == 0
