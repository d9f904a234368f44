"""The PingPong kernel's epilogue data movement: shared buffers of the visitor's outputs
and operands, their TMA boxes, and the register <-> shared-memory copies of a subtile (a
mixin of :class:`coda.mainloop.kernel.PingPongGemm`).

Sits in ``coda.mainloop``. Values of width 1 move with the accumulator's stmatrix /
ldmatrix copies; width-2 16-bit values move as 32-bit column pairs on an fp32 view of the
same swizzled buffer; other widths element by element in the order of
:mod:`coda.mainloop.fragment`.
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


class EpilogueIO:
    """Epilogue buffer and copy helpers of the PingPong kernel."""

    def _allocate_epi(self, smem, dtypes, widths, layouts):
        """Shared buffers of the epilogue's outputs (or operands): for each, the view TMA
        uses and the view the register copies use (the same tensor, except for packed
        width-2 16-bit buffers, also seen as fp32 column pairs: a 128-byte row either
        way, so the same 128B swizzle)."""
        tma_views, reg_views = [], []
        for i in range(len(dtypes)):
            lay = layouts[i]
            raw = smem.allocate(cute.cosize(lay.outer) * dtypes[i].width // 8, 1024)
            tma_views.append(
                cute.make_tensor(cute.recast_ptr(raw, lay.inner, dtype=dtypes[i]), lay.outer)
            )
            if packed(dtypes[i], widths[i]):
                stages = cute.size(lay.outer, mode=[2])
                pairs = sm90_utils.make_smem_layout_epi(
                    Float32, LayoutEnum.ROW_MAJOR, self.config.epi_tile, stages
                )
                reg_views.append(
                    cute.make_tensor(cute.recast_ptr(raw, pairs.inner, dtype=Float32), pairs.outer)
                )
            else:
                reg_views.append(tma_views[-1])
        return tuple(tma_views), tuple(reg_views)

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
