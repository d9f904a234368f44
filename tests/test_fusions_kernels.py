"""CPU CI for the fusions' kernels: every epilogue ``coda.fusions`` runs traces into the
PingPong kernel in the operand layout its op uses (forward / map passes: A and B K-major;
dgrad epilogues: B = W.t(), N-major), compiles for sm_90a in the config and finalize
placement ``epi(A, B)`` picks, and its SASS runs the GEMM on HGMMA with no local memory
(LDL/STL)."""

from __future__ import annotations

import pytest
import torch

from coda.fusions import epilogues as E
from coda.runtime import gemm_kernels
from coda.runtime.epilogue_kernels import epilogue_placement
from coda.runtime.fused import FusedVisitor, unsupported
from coda.runtime.sass import count_prefix, disassemble, find_nvdisasm, opcode_counts

pytestmark = pytest.mark.compile
BF16, F32 = torch.bfloat16, torch.float32
FWD, DGRAD = ("k", "k"), ("k", "n")

CASES = {
    "residual_norm": (lambda: E.residual_norm(BF16, BF16, 1e-5), FWD),
    "norm_stats": (lambda: E.norm_stats(BF16, BF16, 1e-5), FWD),
    "row_scale": (lambda: E.row_scale(BF16), FWD),
    "swiglu_forward": (lambda: E.swiglu_forward(BF16), FWD),
    "rope_forward": (lambda: E.rope_forward(BF16), FWD),
    "scaled_grad": (lambda: E.scaled_grad(BF16), FWD),
    "rope_backward": (lambda: E.rope_backward(BF16), FWD),
    "swiglu_backward": (lambda: E.swiglu_backward(BF16), DGRAD),
    "norm_dgrad": (lambda: E.norm_dgrad(BF16, BF16, False), DGRAD),
    "norm_dgrad_residual": (lambda: E.norm_dgrad(BF16, F32, True), DGRAD),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fusion_epilogue_compiles_without_spills(name, tmp_path):
    build, layout = CASES[name]
    epi = build()
    assert unsupported(epi) is None
    # the kernel a call runs: its tile, finalize placement and early-finalize arrivals
    cfg, in_kernel, early = epilogue_placement(
        epi, BF16, 8192, 8192, 8192, num_sms=132, majors=layout
    )
    key = gemm_kernels.GemmKernelKey(
        cfg, BF16, FusedVisitor(epi, in_kernel, early), a_major=layout[0], b_major=layout[1]
    )
    ptx, cubin = gemm_kernels.compile_artifacts(key, str(tmp_path))
    # a map pass's epilogue (scaled_grad) never reads acc: no mainloop, no WGMMA
    reads_acc = FusedVisitor(epi).reads_acc
    assert ("wgmma.mma_async" in ptx) == reads_acc and len(cubin) > 0
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed")
    ops = opcode_counts(disassemble(cubin))
    assert (count_prefix(ops, "HGMMA") > 0) == reads_acc
    assert count_prefix(ops, "LDL") == 0 and count_prefix(ops, "STL") == 0, "spills"


#: Llama 3.2 1B's forward GEMMs at K = 2048 whose plain GEMM runs 128 x 192 tiles
#: (``WIDE_EPILOGUE_MAX_K``): the QKV + RoPE (N = 3072) and gate/up + SwiGLU (N = 2F)
WIDE_CASES = {
    "rope_forward": (lambda: E.rope_forward(BF16), (8192, 3072, 2048)),
    "swiglu_forward": (lambda: E.swiglu_forward(BF16), (8192, 16384, 2048)),
}


@pytest.mark.parametrize("name", list(WIDE_CASES))
def test_short_k_forward_epilogues_run_wide_tiles_without_spills(name, tmp_path):
    """The heuristic's 128 x 192 tile holds these epilogues without local memory, so
    ``epi(A, B)`` keeps it (a spilling one would be narrowed to 128 x 128)."""
    build, (m, n, k) = WIDE_CASES[name]
    epi = build()
    cfg, in_kernel, early = epilogue_placement(epi, BF16, m, n, k, num_sms=132)
    assert (cfg.tile_m, cfg.tile_n) == (128, 192), cfg
    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed")
    key = gemm_kernels.GemmKernelKey(cfg, BF16, FusedVisitor(epi, in_kernel, early))
    ops = opcode_counts(disassemble(gemm_kernels.compile_artifacts(key, str(tmp_path))[1]))
    assert count_prefix(ops, "HGMMA") > 0
    assert count_prefix(ops, "LDL") == 0 and count_prefix(ops, "STL") == 0, "spills"
