"""Where a fused epilogue's time goes inside the kernel: a per-tile timeline of SM clocks.

    python benchmarks/epilogue_timeline.py [--m 16384] [--size 2048] [--variants a,b]
        [--burst 30] [--waits] [--precompile N]
        [--out benchmarks/results/epilogue_timeline_h200.json] (+ a PNG)

``--variants`` names any of the variants and probes below or any catalogue epilogue
(``coda.testing.catalog.EPILOGUES``: ``row_scale``, ``silu_max``, ``rope``, ...);
``--precompile N`` compiles the named kernels in N processes first (the disk cache).

Each variant of ``epilogue_anatomy.py`` (``store_acc`` is the plain GEMM's work), and the
synthetic ``probes`` here (``fma16``, ``fma64``, ``exp8``: ALU or MUFU work on acc reduced
to a row sum, no M x N traffic; ``fma16_rolled``: fma16's FMAs in a loop the kernel does
not unroll; ``shfl16``: as many warp shuffles instead; ``hfma16_bf16`` / ``hfma16_f16``:
fma16's chain on packed 16-bit pairs, half its instructions (``HFMA2.BF16_V2`` /
``HFMA2``); ``hfma32_bf16``: as many packed instructions as fma16 has FMAs;
``dfma16``: fma16's chain in fp64 (``DFMA``); ``imad16`` / ``lop16``: 16 integer steps per
element (``IMAD``; ``SHF`` + ``LOP3``) on acc converted to int32; ``cvt16`` /
``cvtpack16``: fma16's chain with each step rounded to bf16 and widened back
(``F2F.BF16.F32``, one element an instruction; ``F2FP.BF16.F32.PACK_AB``, two, as a
16-bit ``TileStore`` converts); ``i2f16`` / ``cvt64_16`` / ``f64cvt16``: fma16's FFMA
with a round trip through int32, int64 or fp64 (with a ``DMUL``) every step;
``imadwide16``: a 64-bit integer multiply-add every step; ``fma16_paced0`` /
``_paced20`` / ``_paced50``: fma16's FFMAs with a ``nanosleep`` of 0 / 20 / 50 ns between
elements (the same FP32 work issued less densely);
``swiglu_bwd_packed_bf16`` / ``_f16``: the catalogue's SwiGLU backward with its products on
packed bf16 pairs (``_f16``: 1 + g (1 - sig) on fp16 pairs), the sigmoid and the row
partial in fp32, converting to and from fp32 around them (an experiment: its values are
not checked here); only when named in ``--variants``), gets a
:class:`Timeline` primitive appended: a user primitive (defined here) with
``reads_clocks``, which the kernel hands two SM clocks (``clock64``) per tile: when the
warpgroup was ready for the tile's mainloop (it reached its tensor-core turn; the read is
issued with the turn's ``BAR.SYNC``, whose blocking is deferred, so it does not wait for
the turn) and when its last WGMMA completed. The primitive reads the clock again when the
tile's epilogue begins (after the epilogue turn) and ends (its last TMA store issued),
and writes the four clocks, the SM and the warpgroup into per-tile partials. The last
call of a burst of ``--burst`` back-to-back calls is the one read (the card at its
steady clock). Per SM, with the tiles in the order the tensor cores ran them (by
mainloop end; the two warpgroups alternate), then the median over SMs (cycles; the
first two tiles of an SM, one per warpgroup, are left out as start-up):

* ``mainloop``: a tile's mainloop, from max(its warpgroup ready, the previous tile's
  mainloop end) to its last WGMMA done; ``ideal``: the tensor cores' time for the tile
  (2 tile_m tile_n K / 4096 FLOP per cycle per SM, dense 16-bit WGMMA on sm_90);
* ``exposed_frac``: the time the tensor cores wait because the warpgroup whose turn it
  is has not finished its previous epilogue (its ready after the previous mainloop end),
  over the SM's span; ``late_frac``: the fraction of tiles where that happened;
* ``epi_wait``: mainloop done -> epilogue begins (waiting for the epilogue turn);
  ``epilogue``: epilogue begin -> end;
* ``period``: the SM's span over its tiles; ``span``: its first ready to its last
  epilogue end; ``tiles``: per SM.

A variant that never reads acc (``gu_copy``) is a map pass with no mainloop: its
``mainloop`` is 0 and only its epilogue numbers mean anything (the PNG leaves it out).
So ``mainloop`` against ``ideal`` (and ``store_acc``'s) says how much slower the
mainloop runs beside an epilogue, and ``exposed_frac`` how much of the epilogue is left
outside the mainloop's shadow. JSON rows ``{"variant", "M", "N", "K", "config",
"kernel_us", "tiles", "ideal", "mainloop", "exposed_frac", "late_frac", "epi_wait",
"epilogue", "period", "span", "mhz", "gemm_us", "tail_us", "sm_mhz", "sample"}``
(``mhz``: span cycles over the call's time from CUDA events, which holds the finalize
kernel's tail too; ``gemm_us``: the GEMM kernel alone and ``tail_us``: what the finalize
kernel adds after it, medians over ``--burst`` more calls under torch.profiler
(``call_split``); ``sm_mhz``: span cycles over ``gemm_us``, the SM
clock; ``sample``: the first SM's records, [ready, mainloop end,
epilogue begin, end, warpgroup] relative to its first ready, in tensor-core order).
With ``--waits`` the primitive also asks for ``TraceTile.mainloop_waits`` (clock reads in
the k-loop) and the rows gain ``stage_wait``, ``mma_issue`` and ``mma_wait``: medians
over SMs of a tile's k-loop cycles after its first k-tile spent waiting for A/B stages,
issuing WGMMAs and waiting for them (``results/epilogue_timeline_waits_h200.json``).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from collections import defaultdict

import attrs
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from epilogue_anatomy import variants  # noqa: E402

from coda.epilogue import Epilogue  # noqa: E402
from coda.geometry import ceil_div  # noqa: E402
from coda.mainloop.config import choose_epilogue_config  # noqa: E402
from coda.primitives import (  # noqa: E402
    Elementwise,
    TileLoad,
    TileReduce,
    TileStore,
    VecLoad,
    ops,
)
from coda.primitives import math as cm  # noqa: E402
from coda.testing.catalog import EPILOGUES  # noqa: E402
from coda.testing.probes import MainloopCycles, store_if  # noqa: E402

#: clocks are written as their low 24 bits (exact in fp32); spans stay far below 2^23
CLOCK_BITS = 24
FIELDS = ("ready", "ml_end", "epi_start", "epi_end", "sm", "wg")
#: with ``--waits``: the k-loop's cycles (after its first k-tile) in its A/B stage waits,
#: its WGMMA issue and its WGMMA waits (``TraceTile.mainloop_waits``)
WAIT_FIELDS = ("stage_wait", "mma_issue", "mma_wait")
#: dense 16-bit WGMMA FLOP per cycle per SM on sm_90 (4 tensor cores x 512 FMA)
FLOP_PER_CYCLE = 4096
#: the last call's per-tile records of each Timeline (by name), from its finalize
RECORDS: dict[str, torch.Tensor] = {}


@attrs.frozen
class Timeline(MainloopCycles):
    """Per tile, rows ``tm * tile_m + i`` of column ``tn`` of the partials (M, tiles_n),
    kept in ``RECORDS[name]`` after a call, hold ``FIELDS[i]``: the warpgroup's ready and
    mainloop-end clocks, the epilogue's begin and end clocks (low ``CLOCK_BITS`` bits),
    the SM id and the warpgroup (``coda.testing.probes.MainloopCycles``'s outputs); with
    ``waits``, then ``WAIT_FIELDS`` (``TraceTile.mainloop_waits``: clock reads in the
    k-loop, so its timings are not the plain kernel's)."""

    waits: bool = False

    @property
    def reads_waits(self) -> bool:
        return self.waits

    def finalize(self, partials, problem, specs):
        # the records are (M, tiles_n), not a row result: kept aside for ``analyse``, the
        # result itself is each row's count of written records (a sanity check)
        records = partials[self.partials].clone()
        RECORDS[self.name] = records
        return {self.name: (records != 0).sum(1).float()}

    def trace_begin_tile(self, tile):
        import cutlass.cute as cute

        return cute.arch.clock64()

    def trace(self, ctx, values, state) -> None:
        return None

    def trace_end_tile(self, tile, state) -> None:
        import cutlass.cute as cute
        from cutlass import Float32, Int32, Int64

        from coda.primitives import tracing

        end = cute.arch.clock64()
        ready, end_ml = tile.mainloop_clocks
        mask = Int64((1 << CLOCK_BITS) - 1)
        tm, tn = tile.tile_coord
        m, n = tile.shape_mn
        row = tm * tile.config.warpgroup_config.tile_m
        vals = [Float32(Int32(c & mask)) for c in (ready, end_ml, state, end)]
        vals += [Float32(cute.arch.smid()), Float32(tracing.warpgroup_index())]
        if self.waits:
            vals += [Float32(Int32(c)) for c in tile.mainloop_waits]
        out = tile.extra(self.partials)
        live = (tracing.thread_in_warpgroup() == 0) & (row < m) & (tn * tile.config.tile_n < n)
        for i, v in enumerate(vals):
            store_if()(out, row + i, tn, v, live)


def _fma_chain(x, n: int):
    y = x
    for _ in range(n):
        y = y * 0.999 + x
    return y


def fma16(x):
    """16 dependent FMAs per element (pure FMA-pipe work)."""
    return _fma_chain(x, 16)


def fma64(x):
    """64 dependent FMAs per element."""
    return _fma_chain(x, 64)


def exp8(x):
    """8 dependent exponentials per element (MUFU work, with a multiply each)."""
    y = x
    for _ in range(8):
        y = cm.exp(y * -0.001)
    return y


def cvt16(x):
    """fma16's chain with each step rounded to bf16 and widened back (``F2FP.BF16.F32.
    PACK_AB``, one per two elements, and an integer widening): what the conversion a
    16-bit ``TileStore`` makes costs beside the mainloop."""
    y = x
    for _ in range(16):
        y = cm.round_to(y * 0.999 + x, torch.bfloat16)
    return y


def cvtpack16(x):
    """``cvt16`` the way a 16-bit ``TileStore`` converts: the step's fragment put into a
    bf16 register buffer (``F2FP.BF16.F32.PACK_AB``, two elements an instruction) and
    widened back from it (``epilogue_io.widen_to_f32``: a shift or a mask an element)."""
    if isinstance(x, torch.Tensor):
        return cvt16(x)
    import cutlass
    import cutlass.cute as cute

    from coda.mainloop.epilogue_io import widen_to_f32

    y = x
    for _ in range(16):
        regs = cute.make_rmem_tensor(cute.make_layout(cute.size(x.shape)), cutlass.BFloat16)
        regs.store((y * 0.999 + x).to(cutlass.BFloat16).reshape(regs.shape))
        y = widen_to_f32(regs).reshape(x.shape)
    return y


def _fma_rolled():
    """A jitted helper (the DSL turns loops into device loops only in jitted code)."""
    import cutlass
    import cutlass.cute as cute

    @cute.jit
    def fma_rolled(x, n: cutlass.Constexpr[int]):
        y = x
        for _ in cutlass.range(n, unroll=1):
            y = y * 0.999 + x
        return y

    return fma_rolled


def fma16_rolled(x):
    """fma16's FMAs in a loop the kernel keeps (``cutlass.range(unroll=1)``): the same
    work, a sixteenth of the code (torch tensors: the same chain)."""
    if isinstance(x, torch.Tensor):
        return _fma_chain(x, 16)
    return _fma_rolled()(x, 16)


def _packed_chain(n: int, narrow: str):
    """``n`` dependent FMAs per element on acc rounded to the 16-bit float ``narrow``
    (``"bf16"``, ``"f16"``): in a kernel each instruction is a packed pair (``HFMA2``),
    so an element costs half an instruction per FMA (torch tensors: the fp32 chain)."""

    def chain(x):
        if isinstance(x, torch.Tensor):
            return _fma_chain(x, n)
        import cutlass

        dt = {"bf16": cutlass.BFloat16, "f16": cutlass.Float16}[narrow]
        xh = x.to(dt)
        y = xh
        for _ in range(n):
            # 0.75: exact in both formats (bf16's 0.999 rounds to 1 and folds away)
            y = y * dt(0.75) + xh
        return y.to(cutlass.Float32)

    chain.__name__ = f"hfma{n}_{narrow}"
    return chain


hfma16_bf16 = _packed_chain(16, "bf16")
hfma16_f16 = _packed_chain(16, "f16")
hfma32_bf16 = _packed_chain(32, "bf16")


def dfma16(x):
    """fma16's chain in fp64 (``DFMA``: the double-precision pipe, not the FP32 one), the
    element widened once before it and narrowed once after (torch tensors: the fp32 chain)."""
    if isinstance(x, torch.Tensor):
        return _fma_chain(x, 16)
    import cutlass

    xd = x.to(cutlass.Float64)
    y = xd
    for _ in range(16):
        y = y * cutlass.Float64(0.999) + xd
    return y.to(cutlass.Float32)


def _fma16_paced(ns: int):
    """fma16 with a ``nanosleep.u32 ns`` before each element's chain but a subtile's first
    (an inline-asm ``mov`` that passes the element through, after the previous element's
    chain): as many FFMAs as fma16, issued less densely (is the k-loop's loss per FFMA or
    per cycle of dense FP32 issue?). ptxas still interleaves neighbouring chains around
    the sleeps (the SASS is not one chain after another), so what this buys is a
    spread-out stream: the epilogue runs 2.3-3.2x fma16's on the H200
    (``results/epilogue_timeline_paced_h200.json``); torch tensors: fma16."""

    def paced(x):
        if isinstance(x, torch.Tensor):
            return _fma_chain(x, 16)
        import cutlass.cute as cute
        from cutlass import Float32
        from cutlass._mlir import ir
        from cutlass._mlir.dialects import llvm

        y = cute.make_rmem_tensor(x.shape, Float32)
        y.store(x)
        prev = None
        for i in range(cute.size(y)):
            xi = y[i]
            if prev is not None:
                xi = Float32(
                    llvm.inline_asm(
                        ir.F32Type.get(),
                        [xi.ir_value(), prev.ir_value()],
                        f"mov.b32 $0, $1;\n\tnanosleep.u32 {ns};",
                        "=f,f,f",
                        has_side_effects=True,
                    )
                )
            v = xi
            for _ in range(16):
                v = v * 0.999 + xi
            y[i] = v
            prev = v
        return y.load()

    paced.__name__ = f"fma16_paced{ns}"
    return paced


def _scalar_chain(step, into: str = "Float32"):
    """16 dependent steps ``v = step(v, x)`` per element of acc, on scalars: fp32, or the
    element converted once to ``into`` (``"Int32"``, ``"Int64"``) and back once at the end
    (torch tensors: the identity; the values are not checked)."""

    def chain(x):
        if isinstance(x, torch.Tensor):
            return x
        import cutlass
        import cutlass.cute as cute
        from cutlass import Float32

        y = cute.make_rmem_tensor(x.shape, Float32)
        y.store(x)
        for i in range(cute.size(y)):
            xi = getattr(cutlass, into)(y[i])
            v = xi
            for _ in range(16):
                v = step(v, xi)
            y[i] = Float32(v)
        return y.load()

    return chain


def _int_chain(step, bits: int = 32):
    """16 dependent integer steps per element on acc converted to int32 (int64 with
    ``bits=64``) once (and back once): which integer pipe slows the k-loop?"""
    return _scalar_chain(step, into=f"Int{bits}")


#: ``IMAD``: integer multiply-add (issued to the FMA pipe on recent GPUs?)
imad16 = _int_chain(lambda v, xi: v * v + xi)
#: ``LOP3`` / ``SHF``: the integer ALU pipe
lop16 = _int_chain(lambda v, xi: (v >> 1) ^ xi)
#: a 64-bit integer multiply-add (``IMAD.WIDE.U32`` + ``IMAD``s)
imadwide16 = _int_chain(lambda v, xi: v * v + xi, bits=64)


def _i2f_step(v, xi):
    from cutlass import Float32, Int32

    return Float32(Int32(v * 0.999 + xi))


def _f64_step(v, xi):
    from cutlass import Float32, Float64

    return Float32(Float64(v * 0.999 + xi) * 1.0000001)


def _cvt64_step(v, xi):
    from cutlass import Float32, Int64

    return Float32(Int64(v * 0.999 + xi))


#: fma16's FFMA with a round trip through int32 each step (``F2I`` + ``I2FP``)
i2f16 = _scalar_chain(_i2f_step)
#: fma16's FFMA with a round trip through fp64 and a ``DMUL`` each step (``F2F.F64.F32`` +
#: ``DMUL`` + ``F2F.F32.F64``)
f64cvt16 = _scalar_chain(_f64_step)
#: fma16's FFMA with a round trip through int64 each step (``F2I.S64`` + ``I2F.S64``)
cvt64_16 = _scalar_chain(_cvt64_step)


def _swiglu_backward_packed(narrow_w: str):
    """``ops.swiglu_backward`` with its products on packed bf16 pairs: the sigmoid in
    fp32, then dg = dy s u (1 + g (1 - s)) and du = dy s g from the operands rounded to
    bf16 (1 + g (1 - s) on fp16 pairs when ``narrow_w`` is ``"f16"``), widened back to
    fp32 for the store (torch tensors: the fp32 op)."""

    def swiglu_backward_packed(g, u, dy):
        if isinstance(g, torch.Tensor):
            return ops.swiglu_backward(g, u, dy)
        import cutlass

        b16 = cutlass.BFloat16
        s = cm.sigmoid_fast(g)
        gb, ub, db, sb = g.to(b16), u.to(b16), dy.to(b16), s.to(b16)
        dys = db * sb
        if narrow_w == "bf16":
            w = gb * (b16(1.0) - sb) + b16(1.0)
        else:
            f16 = cutlass.Float16
            w = (g.to(f16) * (f16(1.0) - s.to(f16)) + f16(1.0)).to(cutlass.Float32).to(b16)
        return (dys * ub * w).to(cutlass.Float32), (dys * gb).to(cutlass.Float32)

    return swiglu_backward_packed


def swiglu_bwd_packed(narrow_w: str) -> Epilogue:
    """The catalogue's ``swiglu_bwd`` with ``_swiglu_backward_packed`` as its map."""
    bf16 = torch.bfloat16
    fn = _swiglu_backward_packed(narrow_w)
    return (
        Epilogue()
        .add(TileLoad("gu", bf16, width=2))
        .add(Elementwise("dgu", fn, ins=("gu", "acc"), pairwise="map"))
        .add(TileStore("dgu", bf16))
        .add(Elementwise("zdz_terms", ops.pair_products, ins=("gu", "dgu"), pairwise="map"))
        .add(TileReduce("zdz", of="zdz_terms", op="sum"))
    )


# ---- the rotary angle in fixed-point turns: an experiment, refuted (forty-eighth session) --
#
# ``ops.rope`` reduces its angle pos * freq as an exact product in fp32: eight FP32-pipe
# instructions an angle (``math.cos_fast_of_product``). The experiment took the position
# apart instead, pos = w + f (w = rint(pos), |f| <= 1/2), and reduced w * freq / (2 pi)
# mod 1 exactly in 64-bit integers, w * T mod 2^64 with T the 64-bit fixed-point fraction
# of freq / (2 pi) (one fp64 product per frequency, derived per column in the kernel):
# three FP32-pipe instructions an angle. Timed beside the catalogue's rope
# (results/rope_fixed_turns_ab_h200.json, results/rope_fixed_turns_parts_h200.json) it
# was far slower: the per-column fp64 work alone (``rope_f64_live``, about 100 fp64 and
# 64-bit conversion instructions a thread and tile) took fused / plain from 1.04 to 1.23
# at N = K = 2048, and the 64-bit multiply with the conversion, T handed in
# (``rope_host_turns``), to 1.08: beside the WGMMAs those cost more than the FP32
# instructions they replace. Values of these variants are not checked.
_TURNS_INV_TWO_PI = 1.0 / (2.0 * math.pi)
_TURNS_RADIANS_PER_UNIT = 6.2831854820251465 * 2.0**-32  # fp32(2 pi) per 2^32 units
_TURNS_MAX_POSITION = 2.0**62


def _shift_right(x, n: int):
    """x >> n; ``>>`` on a ``TensorSSA`` gives the DSL's bare vector type, re-wrapped."""
    import cutlass.cute as cute

    shifted = x >> n
    if isinstance(x, cute.TensorSSA):
        shifted = cute.TensorSSA(shifted, x.shape, x.dtype)
    return shifted


def _high_word(x):
    """The high 32 bits of 64-bit integers, as Int32."""
    import cutlass

    return _shift_right(x, 32).to(cutlass.Int32)


def _position_parts(pos):
    """(w as Int64, f): the whole and fractional parts of fp32 positions (f NaN past
    2^62 and for NaN / inf)."""
    import cutlass
    import cutlass.cute as cute

    whole = cute.math.roundeven(pos)
    part = cm._cute_where(cute.math.abs(pos) < _TURNS_MAX_POSITION, pos - whole, math.nan)
    return whole.to(cutlass.Int64), part


def _fixed_turns(freq):
    """T: freq / (2 pi) turns, whole turns dropped, in 2^-64 turns (fp64 in the kernel)."""
    import cutlass
    import cutlass.cute as cute

    turns = freq.to(cutlass.Float64) * _TURNS_INV_TWO_PI
    turns = turns - cute.math.roundeven(turns)
    return (turns * 2.0**64).to(cutlass.Int64)


def _rotate(x, y, angle):
    c, s = cm._cute_approx("cos", angle), cm._cute_approx("sin", angle)
    return x * c - y * s, y * c + x * s


def _rope_fixed_turns(x, y, pos, freq):
    """``ops.rope`` on the fixed-point angle: the wrapped product's high word (2^-32
    turns) converted to fp32 (``I2FP``), one FMA with f freq (torch tensors: ``ops.rope``)."""
    if isinstance(x, torch.Tensor):
        return ops.rope(x, y, pos, freq)
    import cutlass

    pos, freq = cm._cute_promote("rope_fixed_turns", (pos, freq))
    whole, part = _position_parts(pos)
    units = _high_word(whole * _fixed_turns(freq))
    angle = cm._cute_fma(units.to(cutlass.Float32), _TURNS_RADIANS_PER_UNIT, part * freq)
    return _rotate(x, y, angle)


def _rope_bits(x, y, pos, freq):
    """``_rope_fixed_turns`` with the high word turned to fp32 by integer adds and a shift
    under the exponent of 2^23 (23 bits; the angle in [0, 2 pi) + f freq) instead of a
    conversion instruction."""
    if isinstance(x, torch.Tensor):
        return ops.rope(x, y, pos, freq)
    import cutlass

    pos, freq = cm._cute_promote("rope_bits", (pos, freq))
    whole, part = _position_parts(pos)
    units = _high_word(whole * _fixed_turns(freq))
    bits = _shift_right(units.to(cutlass.Uint32) + 256, 9) + 0x4B000000
    x23 = bits.bitcast(cutlass.Float32).reshape(bits.shape)
    two_pi = 6.2831854820251465
    angle = cm._cute_fma(x23, two_pi * 2.0**-23, cm._cute_fma(part, freq, -two_pi))
    return _rotate(x, y, angle)


def _rope_host_turns(x, y, pos, freq, t_lo, t_hi):
    """``_rope_fixed_turns`` with T handed in (two fp32 column vectors holding its 32-bit
    halves' bits) instead of derived in fp64 in the kernel."""
    if isinstance(x, torch.Tensor):
        return ops.rope(x, y, pos, freq)
    import cutlass

    pos, freq, t_lo, t_hi = cm._cute_promote("rope_host_turns", (pos, freq, t_lo, t_hi))
    whole, part = _position_parts(pos)
    lo = t_lo.bitcast(cutlass.Uint32).reshape(t_lo.shape).to(cutlass.Int64)
    hi = t_hi.bitcast(cutlass.Int32).reshape(t_hi.shape).to(cutlass.Int64)
    units = _high_word(whole * (hi * 4294967296 + lo))
    angle = cm._cute_fma(units.to(cutlass.Float32), _TURNS_RADIANS_PER_UNIT, part * freq)
    return _rotate(x, y, angle)


def _rope_f64_live(x, y, pos, freq):
    """``ops.rope`` (the exact-product angle) with ``_fixed_turns``' per-column fp64 work
    kept alive by adding a value below 2^-60 to freq: the fp64 part alone."""
    if isinstance(x, torch.Tensor):
        return ops.rope(x, y, pos, freq)
    import cutlass

    pos, freq = cm._cute_promote("rope_f64_live", (pos, freq))
    tiny = _high_word(_fixed_turns(freq)).to(cutlass.Float32) * 2.0**-92
    return ops.rope(x, y, pos, freq + tiny)


def rope_variant(fn, extra_cols: tuple[str, ...] = ()) -> Epilogue:
    """The catalogue's ``rope`` with ``fn`` as its map (and ``extra_cols`` as more fp32
    column vectors of width 1/2 that it takes)."""
    f32 = torch.float32
    epi = Epilogue().add(VecLoad("pos", per="row", dtype=f32))
    for name in ("freq", *extra_cols):
        epi = epi.add(VecLoad(name, per="col", dtype=f32, width="1/2"))
    ins = ("acc", "pos", "freq", *extra_cols)
    return epi.add(Elementwise("y", fn, ins=ins, pairwise="map")).add(
        TileStore("y", torch.bfloat16)
    )


def shfl16(x):
    """16 dependent butterfly shuffles per element (work for the MIO queue that the
    k-loop's WGMMA issue may share; an even count, so the value comes back unchanged: the
    torch reference is the identity)."""
    if isinstance(x, torch.Tensor):
        return x
    import cutlass.cute as cute
    from cutlass import Float32

    y = cute.make_rmem_tensor(x.shape, Float32)
    y.store(x)
    for _ in range(16):
        for i in range(cute.size(y)):
            y[i] = cute.arch.shuffle_sync_bfly(y[i], offset=1)
    return y.load()


def probes() -> dict[str, Epilogue]:
    """Synthetic epilogues with no M x N traffic: ALU or MUFU work on acc, reduced to a
    row sum so that it is kept (what of the epilogue's work slows the mainloop?), and the
    packed-math experiments on SwiGLU backward."""

    def reduced(fn):
        return (
            Epilogue()
            .add(Elementwise("y", fn, ins=("acc",)))
            .add(TileReduce("r", of="y", op="sum"))
        )

    return {
        "fma16": reduced(fma16),
        "fma16_rolled": reduced(fma16_rolled),
        "shfl16": reduced(shfl16),
        "hfma16_bf16": reduced(hfma16_bf16),
        "hfma16_f16": reduced(hfma16_f16),
        "hfma32_bf16": reduced(hfma32_bf16),
        "swiglu_bwd_packed_bf16": swiglu_bwd_packed("bf16"),
        "swiglu_bwd_packed_f16": swiglu_bwd_packed("f16"),
        "fma16_paced0": reduced(_fma16_paced(0)),
        "fma16_paced20": reduced(_fma16_paced(20)),
        "fma16_paced50": reduced(_fma16_paced(50)),
        "dfma16": reduced(dfma16),
        "imad16": reduced(imad16),
        "lop16": reduced(lop16),
        "fma64": reduced(fma64),
        "exp8": reduced(exp8),
        "cvt16": reduced(cvt16),
        "cvtpack16": reduced(cvtpack16),
        "i2f16": reduced(i2f16),
        "f64cvt16": reduced(f64cvt16),
        "cvt64_16": reduced(cvt64_16),
        "imadwide16": reduced(imadwide16),
    }


def _write(out, row, col, vals, live):
    import cutlass.cute as cute

    @cute.jit
    def body(out, row, col, v0, v1, v2, v3, v4, v5, live):
        if live:
            out[row, col] = v0
            out[row + 1, col] = v1
            out[row + 2, col] = v2
            out[row + 3, col] = v3
            out[row + 4, col] = v4
            out[row + 5, col] = v5

    body(out, row, col, *vals, live)


def _unwrap(xs: list[float], ref: float) -> list[float]:
    """Clock values relative to ``ref``, undoing the 24-bit wrap."""
    full = 1 << CLOCK_BITS
    out = []
    for x in xs:
        d = (x - ref) % full
        out.append(d - full if d >= full // 2 else d)
    return out


def analyse(tl: torch.Tensor, tile_m: int, waits: bool = False) -> dict:
    """Per-SM timelines from the Timeline output ``tl`` (M, tiles_n), summarized."""
    t = tl.cpu()
    tiles_m = ceil_div(t.shape[0], tile_m)
    fields = FIELDS + (WAIT_FIELDS if waits else ())
    per_sm: dict[int, list[list[float]]] = defaultdict(list)
    for i in range(tiles_m):
        r = i * tile_m
        if r + len(fields) > t.shape[0]:
            continue
        for j in range(t.shape[1]):
            rec = t[r : r + len(fields), j].tolist()
            if rec[0] == 0 and rec[1] == 0:  # never written (no tile there)
                continue
            per_sm[int(rec[4])].append(rec)
    stats = defaultdict(list)
    sample = None
    for sm, recs in sorted(per_sm.items()):
        ref = recs[0][0]
        rel = [_unwrap(r[:4], ref) + [r[5]] for r in recs]
        rel.sort(key=lambda r: r[1])  # tensor-core order: by mainloop end
        if sample is None:  # one SM's records, for reading by eye
            base = min(r[0] for r in rel)
            sample = {
                "sm": sm,
                "records": [[int(x - base) for x in r[:4]] + [int(r[4])] for r in rel],
            }
        span = max(r[3] for r in rel) - min(r[0] for r in rel)
        ml, exposed, late = [], 0.0, 0
        for prev, cur in zip(rel[1:], rel[2:], strict=False):
            ml.append(cur[1] - max(cur[0], prev[1]))
            if cur[0] > prev[1]:
                exposed += cur[0] - prev[1]
                late += 1
        steady = rel[2:] or rel
        stats["mainloop"].append(statistics.median(ml) if ml else 0.0)
        stats["exposed_frac"].append(exposed / span if span else 0.0)
        stats["late_frac"].append(late / max(1, len(ml)))
        stats["epi_wait"].append(statistics.median(r[2] - r[1] for r in steady))
        stats["epilogue"].append(statistics.median(r[3] - r[2] for r in steady))
        if waits:  # the raw records' wait fields, steady tiles (not the first two)
            raw = sorted(recs, key=lambda r: _unwrap([r[1]], ref)[0])[2:] or recs
            for i, f in enumerate(WAIT_FIELDS):
                stats[f].append(statistics.median(r[len(FIELDS) + i] for r in raw))
        stats["period"].append(span / len(rel))
        stats["span"].append(span)
        stats["tiles"].append(len(rel))
    return {**{k: statistics.median(v) for k, v in stats.items()}, "sample": sample}


def call_split(fn, reps: int) -> tuple[float, float]:
    """(GEMM kernel us, finalize tail us): medians over ``reps`` profiled calls of the GEMM
    kernel's duration and of what the call's later kernels add after it (the span from
    the GEMM's start to the call's last kernel's end, minus the GEMM). Per call, so that
    a burst whose clock drifts does not pair one call's GEMM with another's span."""
    kernels = common.profiled_kernels(fn, reps)
    calls = []  # [gemm start, gemm end, call end] in ns
    for start, dur, name in kernels:
        if "codamainloop" in name:
            calls.append([start, start + dur, start + dur])
        elif "finalize" in name and calls:
            calls[-1][2] = max(calls[-1][2], start + dur)
    if not calls:
        raise RuntimeError("no GEMM kernel in the profile")
    gemm = statistics.median((b - a) / 1e3 for a, b, _ in calls)
    tail = statistics.median((c - b) / 1e3 for _, b, c in calls)
    return gemm, tail


def plot(rows: list[dict], path: str) -> None:
    """Per variant, a tile's period in cycles split into the tensor cores' ideal time, the
    mainloop's slowdown beside the other warpgroup's epilogue, the exposed epilogue and
    the rest (start-up, tail, hand-overs)."""
    plt = common.pyplot()
    if plt is None:
        print("matplotlib not installed: no PNG", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 5))
    rows = [r for r in rows if r["mainloop"] > 0]  # map passes (no mainloop) left out
    xs = range(len(rows))
    ideal = [r["ideal"] for r in rows]
    slow = [max(0.0, r["mainloop"] - r["ideal"]) for r in rows]
    exposed = [r["exposed_frac"] * r["period"] for r in rows]
    parts = zip(rows, ideal, slow, exposed, strict=True)
    rest = [max(0.0, r["period"] - a - b - c) for r, a, b, c in parts]
    bottom = [0.0] * len(rows)
    for ys, label in (
        (ideal, "tensor cores' ideal"),
        (slow, "mainloop slowdown"),
        (exposed, "exposed epilogue"),
        (rest, "rest (start-up, tail)"),
    ):
        ax.bar(xs, ys, bottom=bottom, label=label)
        bottom = [b + y for b, y in zip(bottom, ys, strict=True)]
    ax.set_xticks(list(xs), [r["variant"] for r in rows], rotation=30, ha="right")
    ax.set_ylabel("SM cycles per tile")
    r0 = rows[0]
    ax.set_title(f"per-tile timeline, M={r0['M']} N=K={r0['N']} (PingPong 128 x 128)")
    ax.legend()
    common.save_figure(plt, fig, path)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results/epilogue_timeline_h200.json")
    p.add_argument("--m", type=int, default=16384)
    p.add_argument("--size", type=int, default=2048, help="N = K")
    p.add_argument("--burst", type=int, default=30)
    p.add_argument("--variants", default=None, help="comma-separated subset")
    p.add_argument(
        "--waits",
        action="store_true",
        help="also split the k-loop into stage waits, WGMMA issue and WGMMA waits (clock reads)",
    )
    common.add_precompile_options(p)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    m = args.m
    n = k = args.size
    cfg = choose_epilogue_config(m, n, k)
    epis = variants()
    if args.variants:
        every = {**EPILOGUES, **epis, **probes()}
        unknown = [name for name in args.variants.split(",") if name not in every]
        if unknown:  # before any GPU work
            raise SystemExit(f"unknown variants {unknown}; known: {sorted(every)}")
        epis = {name: every[name] for name in args.variants.split(",")}
    bf16 = torch.bfloat16
    A = torch.randn(m, k, device="cuda").to(bf16)
    B = torch.randn(n, k, device="cuda").to(bf16) / k**0.5

    def timed_call(epi: Epilogue):
        timed = epi.add(Timeline("timeline", waits=args.waits))
        _, _, tensors = common.cuda_inputs(epi, m, n, k)
        return lambda: timed(A, B, config=cfg, **tensors)

    def compile_one(name: str) -> None:  # one call compiles (and runs) its kernel
        timed_call(epis[name])()

    script = os.path.abspath(__file__)
    if common.precompiled(args, argv, script, list(epis), compile_one):
        return
    rows = []
    for name, epi in epis.items():
        run = timed_call(epi)
        for _ in range(args.burst):
            run()
        kernel_ms = common.time_once(run, args.burst)
        run()
        torch.cuda.synchronize()
        s = analyse(RECORDS["timeline"], cfg.warpgroup_config.tile_m, args.waits)
        # after the records are read: the profiled calls overwrite them
        gemm_us, tail_us = call_split(run, reps=args.burst)
        ideal = 2 * cfg.warpgroup_config.tile_m * cfg.tile_n * k / FLOP_PER_CYCLE
        rows.append(
            {
                "variant": name,
                "M": m,
                "N": n,
                "K": k,
                "config": str(cfg),
                "kernel_us": kernel_ms * 1e3,
                "ideal": ideal,
                **s,
                "mhz": s["span"] / (kernel_ms * 1e3),
                "gemm_us": gemm_us,
                "tail_us": tail_us,
                "sm_mhz": s["span"] / gemm_us,
            }
        )
        print({k: v for k, v in rows[-1].items() if k != "sample"}, flush=True)
    common.write_json(args.out, {**common.environment(), "rows": rows})
    plot(rows, os.path.splitext(args.out)[0] + ".png")
    common.print_table(
        rows,
        ["variant", "kernel_us", "gemm_us", "tail_us", "tiles", "ideal", "mainloop"]
        + ["exposed_frac", "late_frac", "epi_wait", "epilogue", "period", "mhz", "sm_mhz"]
        + (list(WAIT_FIELDS) if args.waits else []),
    )


if __name__ == "__main__":
    main()
