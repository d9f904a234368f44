"""CPU CI for ``GemmConfig.staggered_copies`` (``coda.mainloop.epilogue_io``).

Three checks, none needing a GPU:

* the bank model: with the thread -> element map of the epilogue's 32-bit copy (read off
  CuTe's tiled copy here) and the 128B swizzle, a 64-bit shared access takes 4 wavefronts
  (the 2-way conflict Nsight Compute measured on the H200) and the staggered order 2;
* the data movement: ``store_staggered`` / ``load_staggered`` run on the host (CuTeDSL
  host code, a CPU tensor in place of shared memory) for all 128 threads of a warpgroup:
  every element lands at its own (row, column), one copy slot moves the half that the
  lane's parity picks, and a load gives back what was stored; the same through the
  kernel's own buffers and copy objects (``EpilogueIO._epi_views``' 128B-swizzled views,
  ``SubtileStore`` / ``SubtileLoad`` with the kernel's register views), staggered and
  not, fp32 tiles and packed width-2 16-bit pairs: every element at the byte TMA's 128B
  swizzle gives its (row, col);
* the kernel: a width-2 catalogue epilogue compiles with the staggered copies, its shared
  accesses still 64-bit (LDS.64 / STS.64, as many as without), no local memory.
"""

import cutlass
import cutlass.cute as cute
import pytest
import torch
from cutlass import Float32, Int32

pytestmark = pytest.mark.compile

ROWS, COLS = 64, 32  # the epilogue subtile, in 32-bit elements
THREADS = 128


def _tiled_mma():
    """The consumer warpgroup's bf16 WGMMA (K-major operands, a 64 x 128 atom tile): what
    the epilogue's copies are laid out against."""
    import cutlass.utils.hopper_helpers as sm90_utils

    return sm90_utils.make_trivial_tiled_mma(
        cutlass.BFloat16,
        cutlass.BFloat16,
        cute.nvgpu.OperandMajorMode.K,
        cute.nvgpu.OperandMajorMode.K,
        Float32,
        (1, 1, 1),
        tiler_mn=(64, 128),
    )


def _copy_and_thread_map():
    """The epilogue's 32-bit register <-> shared tiled copy, and each thread's (row, col)
    of its 16 values in copy order (CuTe host code)."""
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.tensor_utils import LayoutEnum

    def make_copy():
        mma = _tiled_mma()
        atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), cutlass.Float16)
        c_atom = cute.make_tiled_copy_C_atom(atom, mma)
        store = sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, Float32, Float32)
        return cute.make_tiled_copy_S(store, c_atom)

    coords = {}

    @cute.jit
    def probe(t: cutlass.Constexpr):
        part = make_copy().get_slice(t).partition_D(cute.make_identity_tensor((ROWS, COLS)))
        coords[t] = [part[j] for j in range(cute.size(part))]

    for t in range(32):  # one warp; the other three repeat it 16 rows down
        probe(t)
    return make_copy, {t: [(int(r), int(c)) for r, c in v] for t, v in coords.items()}


@pytest.fixture(scope="module")
def copy_map():
    return _copy_and_thread_map()


def _swizzle_128b(byte: int) -> int:
    return byte ^ (((byte >> 7) & 7) << 4)


def _wavefronts(thread_map, staggered: bool) -> float:
    """Mean shared-memory wavefronts per 64-bit instruction of one warp: each thread moves
    two adjacent 32-bit columns per instruction; a 64-bit access is served a half-warp at a
    time, each bank one 4-byte word per wavefront."""
    per_instr = []
    for slot in range(4):  # the four 8-column groups of a row: one instruction each
        total = 0
        for half in (range(16), range(16, 32)):
            words: dict[int, set[int]] = {}
            for t in half:
                row, col0 = thread_map[t][0]
                group = slot ^ (2 * ((t >> 2) & 1)) if staggered else slot
                for col in (col0 + 8 * group, col0 + 8 * group + 1):
                    byte = _swizzle_128b(4 * (row * COLS + col))
                    words.setdefault(byte // 4 % 32, set()).add(byte)
            total += max(len(w) for w in words.values())
        per_instr.append(total)
    return sum(per_instr) / len(per_instr)


def test_thread_map_is_the_accumulator_fragment(copy_map):
    _, tmap = copy_map
    for t, coords in tmap.items():
        r0, c0 = t // 4, 2 * (t % 4)
        want = {(r0 + 8 * i, c0 + d + 8 * g) for i in (0, 1) for d in (0, 1) for g in range(4)}
        assert set(coords) == want, t


def test_bank_model_staggering_halves_the_wavefronts(copy_map):
    _, tmap = copy_map
    assert _wavefronts(tmap, staggered=False) == 4.0  # as measured (ncu_smem_h200.json)
    assert _wavefronts(tmap, staggered=True) == 2.0  # 256 bytes: the ideal


def _run_on_host(make_copy, slots):
    from cutlass.cute.runtime import from_dlpack

    from coda.mainloop.epilogue_io import load_staggered, stagger_parity, store_staggered

    @cute.jit
    def one_thread(smem: cute.Tensor, back: cute.Tensor, t: Int32):
        thr = make_copy().get_slice(t)
        ident = thr.partition_S(cute.make_identity_tensor((ROWS, COLS)))
        regs = cute.make_rmem_tensor(ident.shape, Float32)
        for j in cutlass.range_constexpr(cute.size(regs)):
            r, c = ident[j]
            regs[j] = Float32(r * 100 + c)
        parity = stagger_parity(t)
        store_staggered(make_copy(), regs, thr.partition_D(smem), parity, slots=slots)
        got = cute.make_rmem_tensor(ident.shape, Float32)
        if cutlass.const_expr(len(slots) == 2):
            load_staggered(make_copy(), thr.partition_S(smem), got, parity)
            for j in cutlass.range_constexpr(cute.size(got)):
                r, c = ident[j]
                back[r, c] = got[j]

    smem = torch.full((ROWS, COLS), -1.0)
    back = torch.full((ROWS, COLS), -1.0)
    args = (from_dlpack(smem), from_dlpack(back))
    compiled = cute.compile(one_thread, *args, Int32(0))
    for t in range(THREADS):
        compiled(*args, Int32(t))
    return smem, back


def test_staggered_store_and_load_move_every_element_to_its_place(copy_map):
    make_copy, _ = copy_map
    smem, back = _run_on_host(make_copy, slots=(0, 1))
    want = torch.arange(ROWS)[:, None] * 100.0 + torch.arange(COLS)[None, :]
    assert torch.equal(smem, want)
    assert torch.equal(back, want)


def test_one_copy_slot_moves_the_half_the_lane_parity_picks(copy_map):
    """Slot 0 alone: even fragment rows (lanes with lane // 4 even) write columns 0-15,
    odd rows columns 16-31; nothing else is written."""
    make_copy, _ = copy_map
    smem, _ = _run_on_host(make_copy, slots=(0,))
    want = torch.arange(ROWS)[:, None] * 100.0 + torch.arange(COLS)[None, :]
    rows = torch.arange(ROWS)[:, None]
    first_half = torch.arange(COLS)[None, :] < 16
    written = torch.where((rows % 2 == 0), first_half, ~first_half)
    assert torch.equal(smem[written], want[written])
    assert bool((smem[~written] == -1.0).all())


#: (dtype, width) of the 32-bit copies: fp32 values, and packed width-2 pairs of a 16-bit
#: type (int16 here: the copies move 32-bit units whatever the 16-bit type, and the host
#: JIT has no fp32 -> bf16 conversion routine on every CPU)
KERNEL_CASES = {"fp32": ("float32", 1), "16bit_pairs": ("int16", 2)}


def _kernel_path_on_host(staggered: bool, case: str, encode: str):
    """The kernel's own epilogue buffers and copy objects, run on the host for every
    thread of a warpgroup: the buffer views of ``EpilogueIO._epi_views`` (the 128B-swizzled
    layout of ``make_smem_layout_epi`` on a 1024-byte aligned CPU buffer in place of shared
    memory; a width-2 16-bit tensor also seen as fp32 column pairs), the
    ``SubtileStore`` / ``SubtileLoad`` of ``_subtile_stores`` / ``_subtile_loads`` with the
    kernel's register views; each value written through the store's ``values`` view at
    its (row, col), copied to the buffer, loaded back and read through the load's
    ``values`` view. Values encode the row or the column (``encode``).
    Returns the raw buffer (as the tensor's dtype, then fp32) and the loaded-back values
    (64, 32 w)."""
    from fractions import Fraction

    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.runtime import from_dlpack
    from cutlass.tensor_utils import LayoutEnum

    from coda.mainloop.config import GemmConfig
    from coda.mainloop.epilogue_io import EpilogueIO, stagger_parity
    from coda.mainloop.fragment import Fragment

    torch_dtype, w = getattr(torch, KERNEL_CASES[case][0]), KERNEL_CASES[case][1]
    dtype = Float32 if torch_dtype == torch.float32 else cutlass.Int16
    cols = COLS * w

    class IO(EpilogueIO):
        acc_dtype = Float32
        config = GemmConfig(tile_n=128, cluster_m=2, staggered_copies=staggered)
        store_dtypes = load_dtypes = (dtype,)
        store_widths = load_widths = (Fraction(w),)

    @cute.jit
    def one_thread(raw: cute.Tensor, back: cute.Tensor, t: Int32):
        io = IO()
        mma = _tiled_mma()
        layout = sm90_utils.make_smem_layout_epi(dtype, LayoutEnum.ROW_MAJOR, io._box(w), 1)
        tma, reg = io._epi_views(raw.iterator, dtype, Fraction(w), layout)
        coord_copy = io._make_r2s_copy(mma, cutlass.BFloat16)
        frag = Fragment(coord_copy, (ROWS, COLS))
        coords = coord_copy.get_slice(t).partition_S(cute.make_identity_tensor((ROWS, COLS)))
        points = [coords[j] for j in range(cute.size(coords))]
        at = frag.points(points, Fraction(w))  # (row, col) of each value at width w
        parity = stagger_parity(t)
        views = ((tma,), (reg,), frag, coords.shape, points, parity)
        store = io._subtile_stores(mma, t, *views)[0]
        load = io._subtile_loads(mma, t, *views)[0]
        for j in cutlass.range_constexpr(len(at)):
            r, c = at[j]
            code = r if cutlass.const_expr(encode == "row") else c
            store.values[j] = dtype(code)
        store(0)
        load(0)
        for j in cutlass.range_constexpr(len(at)):
            r, c = at[j]
            back[r, c] = load.values[j].to(Float32)

    nbytes = ROWS * cols * torch_dtype.itemsize
    big = torch.full((nbytes + 1024,), 0xFF, dtype=torch.uint8)  # -1 / NaN: unwritten
    start = -big.data_ptr() % 1024
    raw = big[start : start + nbytes]
    back = torch.full((ROWS, cols), -1.0)
    args = (from_dlpack(raw, assumed_align=1024), from_dlpack(back))
    compiled = cute.compile(one_thread, *args, Int32(0))
    for t in range(THREADS):
        compiled(*args, Int32(t))
    return raw.view(torch_dtype).float(), back


def _tma_128b(rows: int, row_bytes: int, elem: int) -> torch.Tensor:
    """Element index, in a buffer written by TMA with 128B swizzle, of each logical
    (row, col) of a (rows, row_bytes / elem) box: byte bits 4-6 XOR bits 7-9."""
    byte = torch.arange(rows)[:, None] * row_bytes + torch.arange(row_bytes // elem) * elem
    return (byte ^ (((byte >> 7) & 7) << 4)) // elem


@pytest.mark.parametrize("case", list(KERNEL_CASES))
@pytest.mark.parametrize("staggered", [False, True], ids=["plain", "staggered"])
def test_kernel_copies_write_where_tma_reads_and_load_back(staggered, case):
    """Every element lands at the byte TMA's 128B swizzle gives its (row, col), and
    comes back through the load."""
    for encode in ("row", "col"):
        raw, back = _kernel_path_on_host(staggered, case, encode)
        cols = back.shape[1]
        rows_, cols_ = torch.meshgrid(torch.arange(ROWS), torch.arange(cols), indexing="ij")
        want = (rows_ if encode == "row" else cols_).float()
        where = _tma_128b(ROWS, 128, 128 // cols)
        assert torch.equal(raw[where], want), encode
        assert torch.equal(back, want), encode


def _fp32_tiles():
    from coda import Epilogue
    from coda.primitives import Elementwise, TileLoad, TileStore, ops

    return (
        Epilogue()
        .add(TileLoad("r", torch.float32))
        .add(Elementwise("x", ops.add, ins=("acc", "r")))
        .add(TileStore("x", torch.float32))
    )


@pytest.mark.parametrize("name", ["swiglu_bwd", "fp32_tiles"])
@pytest.mark.parametrize("layout", [("k", "k"), ("m", "n")], ids=["fwd", "wgrad"])
def test_staggered_kernel_keeps_64bit_shared_accesses_and_no_spills(name, layout, tmp_path):
    """swiglu_bwd: packed width-2 bf16 pairs in and out; fp32_tiles: an fp32 tile in and
    out (width 1)."""
    from coda.mainloop.config import GemmConfig
    from coda.runtime import gemm_kernels
    from coda.runtime.fused import FusedVisitor
    from coda.runtime.sass import count_prefix, disassemble, find_nvdisasm, opcode_counts
    from coda.testing.catalog import EPILOGUES

    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed")
    epi = EPILOGUES[name] if name in EPILOGUES else _fp32_tiles()
    counts = {}
    for staggered in (False, True):
        cfg = GemmConfig(tile_n=128, cluster_m=2, staggered_copies=staggered)
        key = gemm_kernels.GemmKernelKey(
            cfg, torch.bfloat16, FusedVisitor(epi), a_major=layout[0], b_major=layout[1]
        )
        _, cubin = gemm_kernels.compile_artifacts(key, str(tmp_path / str(staggered)))
        counts[staggered] = opcode_counts(disassemble(cubin))
    for ops in counts.values():
        assert count_prefix(ops, "LDL") == 0 and count_prefix(ops, "STL") == 0
    for op in ("LDS.64", "STS.64"):
        assert counts[True].get(op, 0) == counts[False].get(op, 0) > 0, op
    # one select per 32-bit value moved: the swap of the two halves
    assert counts[True].get("FSEL", 0) > counts[False].get("FSEL", 0)
