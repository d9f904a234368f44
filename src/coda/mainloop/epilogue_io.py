"""The PingPong kernel's epilogue data movement: shared buffers of the visitor's outputs
and operands, their TMA boxes, and the register <-> shared-memory copies of a subtile (a
mixin of :class:`coda.mainloop.kernel.PingPongGemm`).

Sits in ``coda.mainloop``. Values of width 1 move with the accumulator's stmatrix /
ldmatrix copies; width-2 16-bit values move as 32-bit column pairs on an fp32 view of the
same swizzled buffer; other widths element by element in the order of
:mod:`coda.mainloop.fragment`.

32-bit copies (fp32 values, packed width-2 pairs) are *staggered*: a thread holds two
adjacent columns (8 bytes) of rows ``lane // 4`` and ``+ 8`` in four 32-byte column groups
of a 128-byte swizzled row. A 64-bit shared access is served a half-warp (4 rows) at a
time, and under the 128B swizzle rows ``2i`` and ``2i + 1`` put the same column group on
the same 8 banks: a 2-way conflict, 4 wavefronts per instruction where 2 are ideal
(Nsight Compute, ``benchmarks/results/ncu_smem_h200.json``). Lanes of odd rows therefore
take their column groups in the order ``g ^ 2`` (the subtile's two 16-column halves
swapped): the 4 rows of a half-warp then land on 4 different bank octets. The values are
swapped to match with selects, so every element still goes to its own address. Opt-in
(``GemmConfig.staggered_copies``): not yet run on a GPU.
"""

from __future__ import annotations

from fractions import Fraction

from .cute_env import ensure_arch

ensure_arch()

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, const_expr
from cutlass.tensor_utils import LayoutEnum

from .fragment import Fragment


def packed(dtype, width: Fraction) -> bool:
    """A width-2 tensor of 16-bit elements moves as 32-bit (column pair) elements."""
    return width == 2 and dtype.width == 16


def value_layout(frag_shape, frag_geom: Fragment, width: Fraction):
    """Register layout of a width-``width`` value's fragment (the accumulator's at 1)."""
    if width == 1:
        return cute.make_layout(frag_shape)
    return cute.make_layout(frag_geom.at_width(width).n)


def as_values(rmem, dtype, layout):
    """A register buffer seen as ``dtype`` elements in ``layout`` (it may hold them packed
    two to a 32-bit element, or be the very tensor)."""
    return cute.make_tensor(cute.recast_ptr(rmem.iterator, dtype=dtype), layout)


def stagger_parity(wg_tidx):
    """1 on the lanes whose accumulator rows are odd (``lane // 4`` odd), else 0: they take
    a 32-bit copy's two column halves in swapped order (see the module doc)."""
    return (wg_tidx >> 2) & 1


def _halves_swapped(parity, a, b):
    """``b`` where ``parity`` is 1, else ``a`` (two register fragments of one shape)."""
    odd = cute.full(a.shape, parity != 0, cutlass.Boolean)
    return cute.where(odd, b, a)


def store_staggered(copy, regs, smem, parity, slots=(0, 1)):
    """Register -> shared copy of a 32-bit subtile fragment, halves staggered by lane
    parity. ``regs`` / ``smem``: the copy's (value, m, n) partitions, n = the two
    16-column halves of the subtile. Copy slot ``n`` moves half ``n ^ parity``; the kernel
    issues both slots (``slots`` lets a test issue one)."""
    for n in slots:
        mine = regs[None, None, n]
        tmp = cute.make_rmem_tensor(mine.layout, mine.element_type)
        tmp.store(_halves_swapped(parity, mine.load(), regs[None, None, 1 - n].load()))
        cute.copy(copy, tmp, smem[None, None, n ^ parity])


def load_staggered(copy, smem, regs, parity):
    """Shared -> register copy of a 32-bit subtile fragment, the inverse of
    :func:`store_staggered`."""
    got = []
    for n in range(2):
        dst = regs[None, None, n]
        tmp = cute.make_rmem_tensor(dst.layout, dst.element_type)
        cute.copy(copy, smem[None, None, n ^ parity], tmp)
        got.append(tmp.load())
    for n in range(2):
        regs[None, None, n].store(_halves_swapped(parity, got[n], got[1 - n]))


def widen_to_f32(values):
    """fp32 values of a register fragment of 16-bit floats. bf16 -> fp32 is exact and
    only moves bits, so a 32-bit register holding two bf16 elements (``values`` compact:
    element ``i`` in 16-bit slot ``i``) gives its low one by a shift and its high one by
    a mask: one integer instruction an element (the generic conversion unpacks the high
    half first, a PRMT and a shift). fp16 and other layouts convert element by element."""
    n = cute.size(values.layout)
    if const_expr(
        values.element_type is not cutlass.BFloat16 or n % 2 != 0 or cute.cosize(values.layout) != n
    ):
        return values.load().to(Float32)
    words = cute.make_tensor(
        cute.recast_ptr(values.iterator, dtype=cutlass.Uint32), cute.make_layout(n // 2)
    ).load()
    out = cute.make_rmem_tensor(values.layout, Float32)
    bits = cute.recast_ptr(out.iterator, dtype=cutlass.Uint32)
    halves = cute.make_layout(n // 2, stride=2)
    low, high = words << 16, words & 0xFFFF0000  # the bits of elements 2k, 2k + 1
    cute.make_tensor(bits, halves).store(cute.TensorSSA(low, words.shape, cutlass.Uint32))
    cute.make_tensor(bits + 1, halves).store(cute.TensorSSA(high, words.shape, cutlass.Uint32))
    return out.load()


class _SubtileCopy:
    """What a subtile copy of one tensor needs: the tiled copy (None: element by element),
    the registers it moves and their ``values`` view (the visitor's fragment), the copy's
    shared-memory partition (or the buffer and ``points``, element by element), and
    whether the 32-bit copy is staggered (``parity``: this lane's)."""

    def __init__(self, copy, regs, values, smem_part, smem, points, staggered, parity):
        self.copy, self.regs, self.values = copy, regs, values
        self.smem_part, self.smem, self.points = smem_part, smem, points
        self.staggered, self.parity = staggered, parity


class SubtileStore(_SubtileCopy):
    """One output's subtile on its way out: the visitor's values go into ``values`` (a
    register fragment), then ``__call__(buf)`` copies them to store buffer ``buf`` of
    shared memory. The copy is stmatrix (16-bit, width 1), a 32-bit copy (fp32 values or
    packed width-2 pairs; staggered with ``GemmConfig.staggered_copies``) or, for other
    widths, element by element at ``points`` (``coda.mainloop.fragment``)."""

    def __call__(self, buf):
        if self.smem_part is None:
            for j, (r, c) in enumerate(self.points):
                self.smem[(r, c, buf)] = self.regs[j]
        elif self.staggered:
            store_staggered(
                self.copy, self.regs, self.smem_part[(None, None, None, buf)], self.parity
            )
        else:
            cute.copy(self.copy, self.regs, self.smem_part[(None, None, None, buf)])


class SubtileLoad(_SubtileCopy):
    """One loaded operand's subtile on its way in: ``__call__(stage)`` copies it from
    stage ``stage`` of the load ring into registers and returns its values as fp32.
    ldmatrix (16-bit, width 1), a 32-bit copy (staggered like :class:`SubtileStore`'s)
    or element by element."""

    def __call__(self, stage):
        if self.smem_part is None:
            for j, (r, c) in enumerate(self.points):
                self.values[j] = self.smem[(r, c, stage)]
        elif self.staggered:
            load_staggered(
                self.copy, self.smem_part[None, None, None, stage], self.regs, self.parity
            )
        else:
            cute.copy(self.copy, self.smem_part[None, None, None, stage], self.regs)
        return widen_to_f32(self.values)


class EpilogueIO:
    """Epilogue buffer and copy helpers of the PingPong kernel."""

    def _subtile_stores(self, tiled_mma, wg_tidx, sD, sD_rs, frag, frag_shape, points, parity):
        """A :class:`SubtileStore` per output (fixed per warpgroup, reused every subtile)."""
        cfg = self.config
        out = []
        for i in range(len(self.store_dtypes)):
            dtype, w = self.store_dtypes[i], self.store_widths[i]
            unit = dtype if w == 1 else Float32
            staggered = cfg.staggered_copies and unit.width == 32
            layout = value_layout(frag_shape, frag, w)
            if packed(dtype, w) or w == 1:
                # width 2 at 16 bits: a column pair is one 32-bit element of an fp32 view
                # of the buffer, laid out like the accumulator
                cp = self._make_r2s_copy(tiled_mma, unit)
                thr = cp.get_slice(wg_tidx)
                part = thr.partition_D(sD_rs[i])
                # the copy groups modes its own way; same elements in the same order
                own = thr.partition_S(cute.make_identity_tensor(cfg.epi_tile)).shape
                regs = cute.make_rmem_tensor(own, unit)
                at = None
            else:
                cp, part, at = None, None, frag.points(points, w)
                regs = cute.make_rmem_tensor(layout, dtype)
            values = as_values(regs, dtype, layout)
            out.append(SubtileStore(cp, regs, values, part, sD[i], at, staggered, parity))
        return out

    def _subtile_loads(self, tiled_mma, wg_tidx, sC, sC_sr, frag, frag_shape, points, parity):
        """A :class:`SubtileLoad` per loaded operand (fixed per warpgroup)."""
        cfg = self.config
        out = []
        for i in range(len(self.load_dtypes)):
            dtype, w = self.load_dtypes[i], self.load_widths[i]
            layout = value_layout(frag_shape, frag, w)
            if packed(dtype, w) or w == 1:
                unit = dtype if w == 1 else Float32
                cp = self._make_s2r_copy(tiled_mma, unit)
                thr = cp.get_slice(wg_tidx)
                part = thr.partition_S(sC_sr[i])
                frag_regs = cute.make_rmem_tensor(frag_shape, unit)
                regs, at = thr.retile(frag_regs), None
                staggered = cfg.staggered_copies and unit.width == 32
            else:
                cp, part, at, staggered = None, None, frag.points(points, w), False
                frag_regs = regs = cute.make_rmem_tensor(layout, dtype)
            values = as_values(frag_regs, dtype, layout)
            out.append(SubtileLoad(cp, regs, values, part, sC[i], at, staggered, parity))
        return out

    def _allocate_epi(self, smem, dtypes, widths, layouts):
        """Shared buffers of the epilogue's outputs (or operands): for each, the view TMA
        uses and the view the register copies use (see :meth:`_epi_views`)."""
        tma_views, reg_views = [], []
        for i in range(len(dtypes)):
            raw = smem.allocate(cute.cosize(layouts[i].outer) * dtypes[i].width // 8, 1024)
            tma, reg = self._epi_views(raw, dtypes[i], widths[i], layouts[i])
            tma_views.append(tma)
            reg_views.append(reg)
        return tuple(tma_views), tuple(reg_views)

    def _epi_views(self, raw, dtype, width, layout):
        """(TMA view, register-copy view) of one buffer at byte pointer ``raw`` (1024-byte
        aligned), laid out by ``layout`` (``make_smem_layout_epi``; its swizzle acts on
        byte addresses, as TMA's does): the same tensor, except for packed width-2 16-bit
        buffers, also seen as fp32 column pairs (a 128-byte row either way, so the same
        128B swizzle)."""
        tma = cute.make_tensor(cute.recast_ptr(raw, layout.inner, dtype=dtype), layout.outer)
        if not packed(dtype, width):
            return tma, tma
        stages = cute.size(layout.outer, mode=[2])
        pairs = sm90_utils.make_smem_layout_epi(
            Float32, LayoutEnum.ROW_MAJOR, self.config.epi_tile, stages
        )
        return tma, cute.make_tensor(cute.recast_ptr(raw, pairs.inner, dtype=Float32), pairs.outer)

    def _box(self, width: Fraction) -> tuple[int, int]:
        """TMA box (= one subtile) of a width-``width`` output or operand."""
        return (self.config.epi_m, int(self.config.epi_n * width))

    def _tile(self, width: Fraction) -> tuple[int, int]:
        """The part of a width-``width`` M x N*w tensor that one output tile covers."""
        return (self.config.tile_m, int(self.config.tile_n * width))

    def _c_atom_tiled(self, tiled_mma):
        c_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4),
            cutlass.Float16,  # only fixes the thread-value layout of the fragment
        )
        return cute.make_tiled_copy_C_atom(c_atom, tiled_mma)

    def _make_r2s_copy(self, tiled_mma, dtype):
        """Register -> shared copy of one subtile: stmatrix for 16-bit, else plain stores."""
        store_atom = sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, dtype, self.acc_dtype)
        return cute.make_tiled_copy_S(store_atom, self._c_atom_tiled(tiled_mma))

    def _make_s2r_copy(self, tiled_mma, dtype):
        """Shared -> register copy of one loaded subtile: ldmatrix for 16-bit, else plain."""
        if const_expr(dtype.width == 16):
            atom = cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), dtype)
        else:
            atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype)
        return cute.make_tiled_copy_S(atom, self._c_atom_tiled(tiled_mma))

    def _acc_subtile_view(self, acc, r2s):
        """View the accumulator as (frag..., (subtile_m, subtile_n)) for the r2s copy.

        The WGMMA accumulator of one thread is ((2, 2, tile_n/8), MMA_M, 1): pairs of
        adjacent columns, rows r and r+8, then 8-column groups. Regroup the column groups
        by 16 so one epi_n-wide subtile is a contiguous block, then divide by subtiles.
        """
        cfg = self.config
        lay = acc.layout
        div = cute.logical_divide(lay, ((None, None, 2), None, None))
        assert cute.size(lay, mode=[2]) == 1, "one MMA atom spans tile_n"
        # ((2, 2, 2), MMA_M, tile_n/16)
        frag = cute.make_layout(
            (
                (div.shape[0][0], div.shape[0][1], div.shape[0][2][0]),
                div.shape[1],
                div.shape[0][2][1],
            ),
            stride=(
                (div.stride[0][0], div.stride[0][1], div.stride[0][2][0]),
                div.stride[1],
                div.stride[0][2][1],
            ),
        )
        acc_v = cute.make_tensor(acc.iterator, frag)
        sub_m, sub_n = cfg.subtiles_per_tile
        per_sub = (frag.shape[0], frag.shape[1] // sub_m, frag.shape[2] // sub_n)
        divided = cute.flat_divide(acc_v, per_sub)
        # ((2,2,2), MMA_M/sub_m, cols/sub_n, 1, sub_m, sub_n) -> group the subtile modes
        view = cute.group_modes(divided[None, None, None, 0, None, None], 3, 5)
        return r2s.retile(view)
