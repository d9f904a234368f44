"""coda.primitives.math: backend-polymorphic math for ``Elementwise`` functions.

An ``Elementwise`` ``fn`` runs on fp32 ``torch.Tensor`` blocks in ``Epilogue.reference`` and
in the tile simulator, and on CuTeDSL register values when traced into the fused kernel.
Write ``fn`` with the operators ``+ - * /`` (which both backends overload), comparisons, and
the functions of this module, never ``torch.*`` or ``cute.*`` directly, and the same ``fn``
will serve both::

    from coda.primitives import math as cm
    fn = lambda g, u: cm.silu(g) * u

Each function dispatches on its arguments:

* ``torch.Tensor`` -> the torch op (dtype preserved, so tests can also evaluate ``fn`` in
  float64). Python numbers are accepted next to a tensor.
* CuTeDSL values (any type from the ``cutlass`` package: ``cute.TensorSSA`` register
  fragments, the kind the fused epilogue passes, and scalar DSL numerics such as
  ``cutlass.Float32``), with Python numbers next to them -> CuTeDSL ops emitted at kernel
  trace time. A scalar next to a ``TensorSSA`` is broadcast to the fragment's shape; Python
  numbers take the dtype of the DSL values (``Float32`` when only scalars meet).
  ``cutlass`` is imported lazily, on the first CuTeDSL call, never at module import.
* Anything else (or only Python numbers, or torch mixed with CuTeDSL) raises ``TypeError``.

CuTeDSL lowering and accuracy (fp32). Every transcendental but sin/cos uses the *accurate*
MLIR ``math`` op (``cute.math.*`` with ``fastmath=False``), which NVVM lowers to libdevice's
fp32 routines (``__nv_expf``, ``__nv_tanhf``, ...); sin/cos are coda's own code (libdevice's
needs local memory, see the table). The PTX ``.approx`` hardware intrinsics appear only
where libdevice uses them inside an accurate routine (``ex2.approx`` after an exact
two-constant range reduction in exp, ``rcp.approx`` inside tanh) or are accurate on
their own (``ex2.approx.f32`` for exp2, ``rsqrt.approx.f32``: <= 2 ulp). The reciprocal
in sigmoid and silu is the one exception: in kernels ``rcp.approx.ftz.f32`` (<= 1 ulp;
results below 2^-126, i.e. x < -87, flush to 0) replaces the IEEE division, whose
per-element slow-path call (``CALL.REL``, ``BSSY`` / ``BSYNC`` in the SASS: 7240 -> 5336
instructions in the SwiGLU-backward kernel) kept that epilogue far longer than the GEMM
tile it hides behind (fused / plain 1.71 at M=16384, N=K=2048, measured before the
change; host ``cute.jit`` code keeps the division). The fast variants were rejected
for the accurate functions (the ``*_fast`` ones below take them where results are stored
in 16 bits): ``tanh.approx.f32`` has a relative error of ~2^-11; ``sin/cos.approx.f32``
an absolute error of ~2^-20 on [-pi, pi] only (without a reduction: useless for RoPE-sized
angles); ``exp(x)`` as
``ex2.approx(x * log2 e)`` loses ~|x| ulp in the product (~7e-6 relative at |x| = 80);
``lg2.approx`` has an absolute, not relative, error bound (bad near x = 1).

Max error measured on an H200 against float64 (``tests/test_math_cute_gpu.py`` cases, 1M
inputs incl. edge values; ulp of the exact result where it exceeds 1e-3, 0.5 = correctly
rounded); torch's own CUDA fp32 kernels measured the same on every function. sin/cos (*):
on the H200 their results are bit-identical to the float32 emulation of
``tests/test_math_cute.py`` (``test_device_sincos_match_emulation``), whose error over
3.6M inputs in [-1e5, 1e5] is the number given:

=====================  =============================================================  ========
function               CuTeDSL implementation                                         ulp
=====================  =============================================================  ========
exp, exp2              ``cute.math.exp / exp2`` (libdevice; ``ex2.approx`` core)      1.9
exp_diff (***)         exp(x - y) as ``ex2.approx.ftz.f32(x log2 e - y log2 e)``,      2 +
                       the subtraction fused into one FMA with y log2 e per row      |x-y|/2
log, log2, log1p       ``cute.math.log / log2 / log1p`` (libdevice polynomials)       0.9
sqrt, rsqrt            ``cute.math.sqrt`` (``sqrt.rn.f32``), ``cute.math.rsqrt``      0.5, 1.5
                       (``rsqrt.approx.f32``)
tanh, erf              ``cute.math.tanh / erf`` (libdevice)                           1.8
sin, cos (*)           coda's own, registers only (libdevice's Payne-Hanek array      1.5
                       became LDL/STL in the fused kernel): j = rint(x 2/pi),         (6.9e-8
                       r = x - j pi/2 in three FMAs (Cody-Waite split of pi/2),       abs)
                       Cephes minimax polynomials for sin r, cos r on [-pi/4, pi/4],
                       the quadrant j mod 4 by select; NaN for +-inf, NaN and past
                       the range |x| <= 2^21 pi/2 ~ 3.29e6 (see ``_cute_sincos``)
sigmoid                ``rcp.approx.ftz.f32(1 + exp(-x))`` (<= 1 ulp reciprocal)      (**)
silu                   ``x * rcp.approx.ftz.f32(1 + exp(-x))`` (silu(-inf) = nan as  (**)
                       in torch)
exp_fast, sigmoid_     ``ex2.approx.ftz.f32(x log2 e)``: two instructions instead of    2 +
fast, silu_fast (****)  libdevice's eight; sigmoid / silu on it as above               |x|
sin_fast, cos_fast     ``sin/cos.approx.f32`` of x reduced to [-pi, pi] by whole turns   (~5e-7
(****)                 (sin/cos's three-FMA split, times 4); NaN past sin/cos's range  abs)
sin_fast_of_product,   the same of a * b kept exact: hi = a b, lo = fma(a, b, -hi)    (~5e-7
cos_fast_of_product    (a b = hi + lo), hi reduced as above and lo added to the        abs)
(****)                 rest (the RoPE angle pos * freq); NaN where fp32(a b) is past
                       the range; float64 a * b on tensors
softplus               ``where(x > 20, x, log1p(exp(x)))`` (torch's beta=1,           2.6
                       threshold=20)
gelu_tanh              ``0.5 x (1 + tanh(k (x + 0.044715 x^3)))``, k = sqrt(2/pi),   (*)
                       in torch's evaluation order
abs                    ``cute.math.abs`` (``abs.f32``)                                exact
round_to               ``x.to(narrow).to(x's dtype)``: the conversion a ``TileStore``  exact
                       applies (round to nearest even), then back
relu, maximum,         ``cute.math.max / min(..., propagate_nan=True)`` (NaN          exact
minimum, clamp         propagates as in torch); clamp = min(max(x, lo), hi), so
                       lo > hi gives hi as in torch
where                  ``cute.where`` (``arith.select``) on fragments, ``select`` on  exact
                       scalars
=====================  =============================================================  ========

(**) sigmoid / silu: 2.8 / 2.9 ulp measured with the IEEE division they used before;
with ``rcp.approx`` (PTX bound: 1 ulp) they pass
``tests/test_math_cute_gpu.py::test_sigmoid_silu_ulp`` (<= 4 ulp) on the H200; the exact
maximum was not recorded.

(***) exp_diff: for softmax-like terms, x <= y (y a row max or log-sum-exp). Two
instructions (FFMA + MUFU.EX2) instead of libdevice exp's eight: the ``ex2.approx`` bound
(2 ulp) plus the rounding of the FMA, about |x - y| * 2^-24 * ln 2 relative (4e-7 at
|x - y| = 10, where the term is 5e-5; terms below 2^-126, x - y < -87, flush to 0). The
cross-entropy gradient uses it (its map pass: 3696 -> 2800 SASS instructions), and so does
the fused log-sum-exp (``LogSumExp``: the catalogue's ``lse_target`` kernel 3696 -> 2392
instructions with its column-only bounds mask, its fused / plain at M = 16384, N = K =
2048 on an H100 1.035-1.053 -> 0.998-1.012; spill-free since the PingPong consumers
took 240 registers, ``coda.mainloop.roles.REGS_CONSUMER``).

(****) The fast functions, for values stored in 16 bits. sin_fast / cos_fast: the
``.approx`` instructions' absolute error (PTX: 2^-20.9 on [-pi, pi]) after an exact
reduction; RoPE's ops (``ops.rope``, ``ops.rope_inverse``) use them: the catalogue's
``rope`` kernel 3200 -> 2136 SASS instructions; checked on the GPU within 2e-6 absolute
(``tests/test_math_cute_gpu.py::FAST_SINCOS_TOL``). exp_fast, sigmoid_fast, silu_fast
(their error is far below bf16's 2^-9): the roundings of log2 e and of x log2 e add up to
|x| 2^-23 relative error to ``ex2.approx``'s 2 ulp (1.2e-5 at |x| = 100), and results below 2^-126
flush to 0. Edge values as torch's: exp_fast(+-inf) = inf / 0, sigmoid_fast(+-inf) = 1 /
0. SwiGLU's ops (``ops.swiglu``, ``ops.swiglu_backward``) use them: on an H200 (M = 16384,
N = K = 2048) their epilogues' fused / plain went 1.009-1.012 -> 0.978-0.996 (forward) and
1.237-1.243 -> 1.211-1.217 (backward)
(``benchmarks/results/swiglu_fast_exp_ab_h200.json``). Checked on the GPU against float64
within 1e-6 + (2e-6 + |x| 2^-23) relative
(``tests/test_math_cute_gpu.py::assert_fast_close``).

(*) gelu_tanh: <= 4.4e-7 absolute; relative error grows for x < -3, where 1 + tanh(...)
cancels (torch's fp32 kernel: the same). Signed zeros may differ from torch (relu(-0.0) is
not guaranteed to match); NaN and +-inf follow torch. sin/cos are NaN past |x| ~ 3.29e6,
where torch's are still accurate.
"""

from __future__ import annotations

import math as _pymath
import numbers
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "abs",
    "clamp",
    "cos",
    "cos_fast",
    "cos_fast_of_product",
    "erf",
    "exp",
    "exp2",
    "exp_diff",
    "exp_fast",
    "gelu_tanh",
    "log",
    "log1p",
    "log2",
    "maximum",
    "minimum",
    "relu",
    "round_to",
    "rsqrt",
    "sigmoid",
    "sigmoid_fast",
    "silu",
    "silu_fast",
    "sin",
    "sin_fast",
    "sin_fast_of_product",
    "softplus",
    "sqrt",
    "tanh",
    "where",
]

_TORCH = "torch"
_CUTE = "cute"

#: torch's softplus threshold (beta = 1): above it, softplus(x) = x.
_SOFTPLUS_THRESHOLD = 20.0
#: sqrt(2 / pi) and the cubic coefficient of the tanh-approximated GELU.
_GELU_BETA = _pymath.sqrt(2.0 / _pymath.pi)
_GELU_KAPPA = 0.044715


def _is_cute_value(x: Any) -> bool:
    """A CuTeDSL value (TensorSSA, Float32, Boolean, ...), detected without importing
    cutlass: every DSL value type lives in the ``cutlass`` package."""
    return type(x).__module__.split(".", 1)[0] == "cutlass"


def _backend(fname: str, args: tuple[Any, ...]) -> str:
    """Which backend ``args`` select: "torch" or "cute"; TypeError for foreign types."""
    has_torch = has_cute = False
    for a in args:
        if isinstance(a, torch.Tensor):
            has_torch = True
        elif _is_cute_value(a):
            has_cute = True
        elif not isinstance(a, numbers.Real):
            raise TypeError(
                f"coda.primitives.math.{fname}: unsupported argument type "
                f"{type(a).__module__}.{type(a).__qualname__}; supported: torch.Tensor "
                "(reference and tile simulator), CuTeDSL values (cute.TensorSSA fragments "
                "and scalar numerics such as cutlass.Float32, at kernel trace time) and "
                "Python numbers next to either."
            )
    if has_torch and has_cute:
        raise TypeError(
            f"coda.primitives.math.{fname}: cannot mix torch.Tensor and CuTeDSL arguments "
            f"(got {', '.join(type(a).__qualname__ for a in args)})"
        )
    if not (has_torch or has_cute):
        raise TypeError(
            f"coda.primitives.math.{fname}: needs at least one torch.Tensor or CuTeDSL "
            f"argument (got only Python numbers: {args!r}); use the math module for constants"
        )
    return _TORCH if has_torch else _CUTE


def _first_tensor(args: tuple[Any, ...]) -> torch.Tensor:
    return next(a for a in args if isinstance(a, torch.Tensor))


def _as_tensor(x: Any, like: torch.Tensor) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    return torch.as_tensor(x, dtype=like.dtype, device=like.device)


# ---- CuTeDSL backend (cutlass imported lazily) -----------------------------------------


def _cute() -> Any:
    """The ``cutlass.cute`` module (imported on first use; callers are tracing a kernel, so
    cutlass is already imported and CUTE_DSL_ARCH already chosen)."""
    import cutlass.cute as cute

    return cute


def _cute_promote(fname: str, args: tuple[Any, ...]) -> list[Any]:
    """Bring DSL values and Python numbers to one kind: all ``TensorSSA`` of one shape and
    dtype if any argument is a ``TensorSSA`` (scalars broadcast, fragments broadcast by
    CuTe's rules), else all scalar numerics of one dtype (the first float DSL scalar's,
    ``Float32`` if none)."""
    import cutlass

    cute = _cute()
    tensors = [a for a in args if isinstance(a, cute.TensorSSA)]
    if tensors:
        dtype = next((t.dtype for t in tensors if t.dtype.is_float), tensors[0].dtype)
        shape = tensors[0].shape
        if any(t.shape != shape for t in tensors[1:]):
            from cutlass.cute.tensor import _infer_broadcast_shape  # pinned DSL version

            shape = _infer_broadcast_shape(*(t.shape for t in tensors))
        out = []
        for a in args:
            if isinstance(a, cute.TensorSSA):
                if a.shape != shape:
                    a = a.broadcast_to(shape)
                out.append(a if a.dtype is dtype else a.to(dtype))
            else:
                out.append(cute.full(shape, _cute_scalar(fname, a, dtype), dtype))
        return out
    dtype = next(
        (type(a) for a in args if isinstance(a, cutlass.Numeric) and type(a).is_float),
        cutlass.Float32,
    )
    return [_cute_scalar(fname, a, dtype) for a in args]


def _cute_scalar(fname: str, a: Any, dtype: Any) -> Any:
    """A Python number or DSL scalar as a scalar numeric of ``dtype``."""
    import cutlass

    if isinstance(a, cutlass.Numeric):
        return a if type(a) is dtype else a.to(dtype)
    if isinstance(a, numbers.Real):
        return dtype(float(a)) if dtype.is_float else dtype(a)
    raise TypeError(
        f"coda.primitives.math.{fname}: unsupported CuTeDSL argument type "
        f"{type(a).__module__}.{type(a).__qualname__}; expected cute.TensorSSA, a cutlass "
        "numeric scalar (e.g. cutlass.Float32) or a Python number"
    )


def _cute_unary_arg(fname: str, x: Any) -> Any:
    """``x`` itself if it is a value CuTeDSL math takes (``TensorSSA`` or a numeric scalar)."""
    import cutlass

    cute = _cute()
    if isinstance(x, (cute.TensorSSA, cutlass.Numeric)):
        return x
    hint = " (load() a cute.Tensor into a TensorSSA first)" if isinstance(x, cute.Tensor) else ""
    raise TypeError(
        f"coda.primitives.math.{fname}: unsupported CuTeDSL argument type "
        f"{type(x).__module__}.{type(x).__qualname__}; expected cute.TensorSSA or a cutlass "
        f"numeric scalar (e.g. cutlass.Float32){hint}"
    )


def _cute_max(a: Any, b: Any, fname: str = "maximum") -> Any:
    a, b = _cute_promote(fname, (a, b))
    return _cute().math.max(a, b, propagate_nan=True)


def _cute_min(a: Any, b: Any, fname: str = "minimum") -> Any:
    a, b = _cute_promote(fname, (a, b))
    return _cute().math.min(a, b, propagate_nan=True)


def _cute_where(cond: Any, a: Any, b: Any) -> Any:
    import cutlass

    cute = _cute()
    if isinstance(cond, numbers.Real):  # a static condition picks a branch at trace time
        return _cute_promote("where", (a, b))[0 if cond else 1]
    a, b = _cute_promote("where", (a, b))  # two fragments of one shape, or two scalars
    if isinstance(a, cute.TensorSSA) or isinstance(cond, cute.TensorSSA):
        if not isinstance(cond, cute.TensorSSA):
            cond = cute.full(a.shape, cond, cutlass.Boolean)
        if not isinstance(a, cute.TensorSSA):
            a = cute.full(cond.shape, a, type(a))
            b = cute.full(cond.shape, b, type(b))
        return cute.where(cond, a, b)  # broadcasts cond against a and b
    return type(a)(cutlass.select_(cond, a, b))


def _in_device_code() -> bool:
    """True while tracing a kernel (a ``gpu.func``), False in host ``cute.jit`` code, which
    the CPU lowers with LLVM and which has no NVVM ``rcp.approx``."""
    from cutlass._mlir import ir

    try:
        op = ir.InsertionPoint.current.block.owner
    except (ValueError, AttributeError):
        return True
    while op is not None:
        if op.name in ("gpu.func", "gpu.module"):
            return True
        op = op.parent
    return False


def _cute_reciprocal(y: Any) -> Any:
    """1 / y: ``rcp.approx.ftz.f32`` in kernels (<= 1 ulp; results below 2^-126 flush to
    0), the IEEE division in host code. The IEEE division's per-element slow-path call made
    SwiGLU epilogues far longer than their GEMM tile (see the module doc)."""
    if _in_device_code():
        return _cute().math.rcp(y, approx=True, ftz=True)
    return 1.0 / y


def _cute_sigmoid(x: Any) -> Any:
    return _cute_reciprocal(1.0 + _cute().math.exp(-x))


def _cute_silu(x: Any) -> Any:
    return x * _cute_reciprocal(1.0 + _cute().math.exp(-x))


def _cute_approx(name: str, t: Any) -> Any:
    """``cute.math.<name>`` (exp2, sin, cos) as its PTX ``.approx.ftz`` instruction, in
    device code. The NVVM intrinsic is scalar-only: fragments take the fast-math lowering
    (the same instruction)."""
    op = getattr(_cute().math, name)
    if isinstance(t, _cute().TensorSSA):
        return op(t, fastmath=True)
    return op(t, approx=True, ftz=True)


def _cute_exp_fast(x: Any) -> Any:
    if not _in_device_code():
        return _cute().math.exp(x)
    return _cute_approx("exp2", x * LOG2E)


def _cute_sigmoid_fast(x: Any) -> Any:
    return _cute_reciprocal(1.0 + _cute_exp_fast(-x))


def _cute_silu_fast(x: Any) -> Any:
    return x * _cute_sigmoid_fast(x)


def _cute_softplus(x: Any) -> Any:
    cm = _cute().math
    return _cute_where(x > _SOFTPLUS_THRESHOLD, x, cm.log1p(cm.exp(x)))


def _cute_gelu_tanh(x: Any) -> Any:
    inner = _GELU_BETA * (x + _GELU_KAPPA * (x * x * x))
    return 0.5 * x * (1.0 + _cute().math.tanh(inner))


# ---- sin / cos: Cody-Waite range reduction + minimax polynomials, no local memory -------
#
# libdevice's __nv_sinf / __nv_cosf fall back to a Payne-Hanek reduction for |x| > 105615
# that indexes a small array in local memory; inside a large fused kernel ptxas keeps it in
# local memory (hundreds of LDL/STL). This version uses registers only:
#
#   j = rint(x * 2/pi)                     (the nearest quarter turn, fp32)
#   r = x - j * pi/2                       (three FMA steps, pi/2 = C1 + C2 + C3)
#   sin x = +-sin r or +-cos r             (quadrant j mod 4; |r| <= ~pi/4)
#
# C1 = fp32(pi/2), C2 = fp32(pi/2 - C1), C3 = fp32(pi/2 - C1 - C2), each rounded to nearest
# from exact rational arithmetic (fractions.Fraction) on a 110-digit decimal of pi;
# pi/2 - (C1 + C2 + C3) = 1.06e-23 (tests/test_math_cute.py re-derives them). Each FMA
# rounds only its sum, never the product j * Ck, so r is accurate to a few fp32 ulp of
# |r| + |j| 4.4e-8, plus |j| * 1.1e-23 from the split's own error.
_SINCOS_TWO_OVER_PI = 0.6366197466850281  # fp32(2/pi), 0x3F22F983
_SINCOS_PIO2_C1 = 1.5707963705062866  # 0x3FC90FDB
_SINCOS_PIO2_C2 = -4.371138828673793e-08  # 0xB33BBD2E
_SINCOS_PIO2_C3 = -1.7151245100058819e-15  # 0xA6F72CED
#: Accepted range of |x * 2/pi| (|x| <= 2^21 pi/2 ~= 3.29e6); beyond it sin/cos return NaN.
#: x * 2/pi in fp32 is off by up to ~0.15 quarter turn at 2^21 (its rounding, 2^-4, plus
#: fp32(2/pi)'s relative error 4e-8 times 2^21), so rint may pick a neighbouring quarter turn
#: and |r| grows past pi/4 (max |r|: 0.79 up to |x| = 1e5, 0.84 up to 8.2e5, 1.02 at the
#: range end), where the polynomials slowly lose accuracy. float32 emulation, abs error:
#: <= 1e-7 up to |x| ~ 8.2e5, <= 7e-7 up to the range end, ~1e-4 at |x| ~ 1e7 and unbounded
#: garbage (|r| >> 1, even inf) from |x| ~ 3e7 on, hence NaN past the range.
_SINCOS_MAX_QUARTER_TURNS = 2.0**21
#: Cephes sinf.c minimax coefficients on [-pi/4, pi/4], highest power first (rounded to fp32):
#: sin r = r + r z (S0 z^2 + S1 z + S2), cos r = 1 + z (-1/2 + z (C0 z^2 + C1 z + C2)), z = r^2.
_SIN_COEFFS = (-1.9515295891e-4, 8.3321608736e-3, -1.6666654611e-1)
_COS_COEFFS = (2.443315711809948e-05, -1.388731625493765e-03, 4.166664568298827e-02)


def _cute_fma(a: Any, b: Any, c: Any) -> Any:
    """a * b + c with one rounding (``math.fma``: ``fma.rn.f32``); Python numbers promoted."""
    a, b, c = _cute_promote("sin/cos", (a, b, c))
    return _cute().math.fma(a, b, c)


def _cute_horner(z: Any, coeffs: tuple[float, ...]) -> Any:
    """coeffs[0] z^(n-1) + ... + coeffs[n-1] by Horner's rule, one FMA per step."""
    p = coeffs[0]
    for c in coeffs[1:]:
        p = _cute_fma(p, z, c)
    return p


def _cute_sin_poly(r: Any, z: Any) -> Any:
    """sin r for |r| <= ~pi/4, z = r * r."""
    return _cute_fma(r * z, _cute_horner(z, _SIN_COEFFS), r)


def _cute_cos_poly(z: Any) -> Any:
    """cos r for |r| <= ~pi/4, z = r * r."""
    return _cute_fma(_cute_horner(z, (*_COS_COEFFS, -0.5)), z, 1.0)


def _cute_sincos(x: Any, quadrant_shift: int, lo: Any = None) -> Any:
    """sin x (``quadrant_shift`` 0) or cos x = sin(x + pi/2) (``quadrant_shift`` 1); of
    x + lo when ``lo`` is given (a float-float angle, |lo| <= ulp(x) / 2: added to the
    reduced r, where it is not lost).

    With x = j pi/2 + r and q = (j + quadrant_shift) mod 4, the result is sin r, cos r,
    -sin r, -cos r for q = 0, 1, 2, 3 (cos x: q = j + 1 gives cos r, -sin r, -cos r, sin r).
    NaN for NaN, +-inf and |x| beyond the reduction's range (``_SINCOS_MAX_QUARTER_TURNS``).
    """
    import cutlass

    cm = _cute().math
    quarter_turns = x * _SINCOS_TWO_OVER_PI
    j = cm.roundeven(quarter_turns)  # cvt.rni: round half to even
    r = _cute_fma(-j, _SINCOS_PIO2_C1, x)  # |r| ~ |x - j pi/2| + |j| 4.4e-8
    r = _cute_fma(-j, _SINCOS_PIO2_C2, r)
    r = _cute_fma(-j, _SINCOS_PIO2_C3, r)
    if lo is not None:
        r = r + lo
    z = r * r
    q = j.to(cutlass.Int32) + quadrant_shift  # two's complement: q & 3 = j mod 4 for j < 0
    value = _cute_where((q & 1) != 0, _cute_cos_poly(z), _cute_sin_poly(r, z))
    value = _cute_where((q & 2) != 0, -value, value)
    # NaN, +-inf (|quarter_turns| is NaN or inf) and out-of-range |x| fail the test: NaN.
    return _cute_where(cm.abs(quarter_turns) <= _SINCOS_MAX_QUARTER_TURNS, value, _pymath.nan)


def _cute_in_fp32(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (written for fp32: its constants are fp32) evaluated in fp32 on values of any
    one numeric dtype (the first argument's; ``_cute_promote`` makes them one), the result
    converted back to that dtype."""

    def op(*args: Any) -> Any:
        import cutlass

        x = args[0]
        dtype = x.dtype if isinstance(x, _cute().TensorSSA) else type(x)
        if dtype is cutlass.Float32:
            return fn(*args)
        return fn(*(a.to(cutlass.Float32) for a in args)).to(dtype)

    return op


@_cute_in_fp32
def _cute_sin(x: Any) -> Any:
    # The reduction turns x = -0.0 into r = +0.0; keep sin(-0) = -0 as torch does.
    return _cute_where(x == 0.0, x, _cute_sincos(x, 0))


@_cute_in_fp32
def _cute_cos(x: Any) -> Any:
    return _cute_sincos(x, 1)


def _cute_sincos_fast(x: Any, cos: bool, lo: Any = None) -> Any:
    """sin x or cos x by ``sin/cos.approx.f32`` of x reduced to [-pi, pi] (whole turns
    taken off with the same three-FMA split as ``_cute_sincos``, scaled by 4: exact); NaN
    where ``_cute_sincos`` gives NaN. Of x + lo when ``lo`` is given (as ``_cute_sincos``).
    Host code: the accurate ones."""
    turns = None  # host code: _cute_sincos is NaN past the range itself
    if not _in_device_code():
        value = _cute_sincos(x, 1 if cos else 0, lo)
    else:
        cm = _cute().math
        turns = x * (_SINCOS_TWO_OVER_PI / 4)  # fp32(1 / (2 pi)): exact scaling of fp32(2/pi)
        j = cm.roundeven(turns)
        r = _cute_fma(-j, 4 * _SINCOS_PIO2_C1, x)
        r = _cute_fma(-j, 4 * _SINCOS_PIO2_C2, r)
        r = _cute_fma(-j, 4 * _SINCOS_PIO2_C3, r)
        if lo is not None:
            r = r + lo
        value = _cute_approx("cos" if cos else "sin", r)
    if not cos:
        value = _cute_where(x == 0.0, x, value)  # sin(-0) = -0, as torch
    if turns is None:
        return value
    in_range = _cute().math.abs(turns) <= _SINCOS_MAX_QUARTER_TURNS / 4
    return _cute_where(in_range, value, _pymath.nan)


@_cute_in_fp32
def _cute_sin_fast(x: Any) -> Any:
    return _cute_sincos_fast(x, False)


@_cute_in_fp32
def _cute_cos_fast(x: Any) -> Any:
    return _cute_sincos_fast(x, True)


def _cute_sincos_fast_of_product(fname: str, a: Any, b: Any, cos: bool) -> Any:
    """sin or cos of a * b in fp32 with the product kept exact: hi = fp32(a b) and
    lo = fma(a, b, -hi), so that a b = hi + lo (the error-free product of two fp32 values);
    hi is reduced as sin_fast / cos_fast reduce their argument and lo added to the reduced
    angle. Results in the arguments' (promoted) dtype."""

    def in_fp32(a: Any, b: Any) -> Any:
        hi = a * b
        lo = _cute_fma(a, b, -hi)
        return _cute_sincos_fast(hi, cos, lo)

    return _cute_in_fp32(in_fp32)(*_cute_promote(fname, (a, b)))


def _torch_sincos_of_product(a: Any, b: Any, fn: Any) -> torch.Tensor:
    """fn(a * b) with the product and fn in float64, rounded to the arguments' float dtype."""
    t = _first_tensor((a, b))
    a, b = _as_tensor(a, t), _as_tensor(b, t)
    dtype = torch.result_type(a, b)
    if not dtype.is_floating_point:
        dtype = torch.get_default_dtype()
    return fn(a.double() * b.double()).to(dtype)


def _cute_math(name: str) -> Callable[[Any], Any]:
    def op(x: Any) -> Any:
        return getattr(_cute().math, name)(x)

    return op


# ---- the public functions --------------------------------------------------------------


def _unary(fname: str, torch_op: Any, cute_op: Callable[[Any], Any], doc: str) -> Any:
    def fn(x: Any) -> Any:
        if _backend(fname, (x,)) == _TORCH:
            return torch_op(x)
        return cute_op(_cute_unary_arg(fname, x))

    fn.__name__ = fn.__qualname__ = fname
    fn.__doc__ = doc
    return fn


exp = _unary("exp", torch.exp, _cute_math("exp"), "e**x")
exp2 = _unary("exp2", torch.exp2, _cute_math("exp2"), "2**x")
log = _unary("log", torch.log, _cute_math("log"), "natural logarithm")
log2 = _unary("log2", torch.log2, _cute_math("log2"), "base-2 logarithm")
log1p = _unary("log1p", torch.log1p, _cute_math("log1p"), "log(1 + x), accurate near 0")
sqrt = _unary("sqrt", torch.sqrt, _cute_math("sqrt"), "square root")
rsqrt = _unary("rsqrt", torch.rsqrt, _cute_math("rsqrt"), "1 / sqrt(x)")
sigmoid = _unary("sigmoid", torch.sigmoid, _cute_sigmoid, "1 / (1 + exp(-x))")
silu = _unary("silu", F.silu, _cute_silu, "x * sigmoid(x) (a.k.a. swish)")
exp_fast = _unary(
    "exp_fast",
    torch.exp,
    _cute_exp_fast,
    "e**x as ex2.approx.ftz(x log2 e) in kernels (two instructions; about 2 ulp + |x| "
    "ulp, results below 2^-126 flush to 0); torch.exp on tensors",
)
sigmoid_fast = _unary(
    "sigmoid_fast",
    torch.sigmoid,
    _cute_sigmoid_fast,
    "sigmoid with exp_fast (for 16-bit results: about 3 ulp + |x| ulp of fp32); "
    "torch.sigmoid on tensors",
)
silu_fast = _unary(
    "silu_fast",
    F.silu,
    _cute_silu_fast,
    "silu with exp_fast (for 16-bit results: about 4 ulp + |x| ulp of fp32); F.silu on tensors",
)
tanh = _unary("tanh", torch.tanh, _cute_math("tanh"), "hyperbolic tangent")
relu = _unary("relu", torch.relu, lambda x: _cute_max(x, 0.0, "relu"), "max(x, 0)")
softplus = _unary(
    "softplus", F.softplus, _cute_softplus, "log(1 + exp(x)); x itself where x > 20 (torch's)"
)
erf = _unary("erf", torch.erf, _cute_math("erf"), "the error function")
cos = _unary("cos", torch.cos, _cute_cos, "cosine (radians)")
sin = _unary("sin", torch.sin, _cute_sin, "sine (radians)")
cos_fast = _unary(
    "cos_fast",
    torch.cos,
    _cute_cos_fast,
    "cosine by cos.approx.f32 of the argument reduced to [-pi, pi] in kernels (within "
    "~1e-6 absolute: for values stored in 16 bits); torch.cos on tensors",
)
sin_fast = _unary(
    "sin_fast",
    torch.sin,
    _cute_sin_fast,
    "sine by sin.approx.f32 of the argument reduced to [-pi, pi] in kernels (within "
    "~1e-6 absolute: for values stored in 16 bits); torch.sin on tensors",
)


def cos_fast_of_product(a: Any, b: Any) -> Any:
    """cos(a * b) with the product taken exactly (a RoPE angle, position * frequency):
    in kernels hi = fp32(a b), lo = fma(a, b, -hi) (a b = hi + lo exactly), hi reduced to
    [-pi, pi] as in ``cos_fast`` and lo added to what is left, then cos.approx.f32 (within
    ~1e-6 absolute of cos of the exact product; NaN past ``cos_fast``'s range, |a b| ~
    3.29e6); either may be a Python number. On tensors ``cos`` of the product in float64,
    rounded to the arguments' dtype. An fp32 product alone is off by up to |a b| 2^-24:
    ~8e-3 radians at 128k positions."""
    if _backend("cos_fast_of_product", (a, b)) == _TORCH:
        return _torch_sincos_of_product(a, b, torch.cos)
    return _cute_sincos_fast_of_product("cos_fast_of_product", a, b, True)


def sin_fast_of_product(a: Any, b: Any) -> Any:
    """sin(a * b) with the product taken exactly: see ``cos_fast_of_product``."""
    if _backend("sin_fast_of_product", (a, b)) == _TORCH:
        return _torch_sincos_of_product(a, b, torch.sin)
    return _cute_sincos_fast_of_product("sin_fast_of_product", a, b, False)


# `abs` shadows the builtin on purpose (mirrors torch/numpy naming)
abs = _unary("abs", torch.abs, _cute_math("abs"), "absolute value")  # noqa: A001


def gelu_tanh(x: Any) -> Any:
    """GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    if _backend("gelu_tanh", (x,)) == _TORCH:
        return F.gelu(x, approximate="tanh")
    return _cute_gelu_tanh(_cute_unary_arg("gelu_tanh", x))


def maximum(a: Any, b: Any) -> Any:
    """Elementwise max(a, b); either may be a Python number. NaN propagates."""
    if _backend("maximum", (a, b)) == _TORCH:
        t = _first_tensor((a, b))
        return torch.maximum(_as_tensor(a, t), _as_tensor(b, t))
    return _cute_max(a, b)


def minimum(a: Any, b: Any) -> Any:
    """Elementwise min(a, b); either may be a Python number. NaN propagates."""
    if _backend("minimum", (a, b)) == _TORCH:
        t = _first_tensor((a, b))
        return torch.minimum(_as_tensor(a, t), _as_tensor(b, t))
    return _cute_min(a, b)


#: log2(e): exp(x) = 2 ** (x * LOG2E)
LOG2E = 1.4426950408889634


def _cute_exp_diff(x: Any, y: Any) -> Any:
    x, y = _cute_promote("exp_diff", (x, y))
    if not _in_device_code():
        return _cute().math.exp(x - y)
    # x * LOG2E - y * LOG2E contracts into one FMA per element; y * LOG2E is shared by the
    # elements of a row (one value broadcast), so the compiler computes it once
    return _cute_approx("exp2", x * LOG2E - y * LOG2E)


def exp_diff(x: Any, y: Any) -> Any:
    """exp(x - y) for softmax-like terms (x <= y, y a row's max or log-sum-exp); either
    may be a Python number. In kernels ``ex2.approx.ftz(x log2 e - y log2 e)``: two
    instructions, within ~2 ulp + |x - y| * 2^-24 relative (see the module doc); in torch
    ``torch.exp(x - y)``."""
    if _backend("exp_diff", (x, y)) == _TORCH:
        t = _first_tensor((x, y))
        return torch.exp(_as_tensor(x, t) - _as_tensor(y, t))
    return _cute_exp_diff(x, y)


def clamp(x: Any, lo: float, hi: float) -> Any:
    """min(max(x, lo), hi) with constant bounds (hi wins if lo > hi)."""
    if _backend("clamp", (x, lo, hi)) == _TORCH:
        return torch.clamp(x, lo, hi)
    return _cute_min(_cute_max(x, lo, "clamp"), hi, "clamp")


def where(cond: Any, a: Any, b: Any) -> Any:
    """``a`` where ``cond`` else ``b`` (cond: a boolean tensor, e.g. ``x > 0``)."""
    if _backend("where", (cond, a, b)) == _TORCH:
        t = _first_tensor((cond, a, b))
        like = a if isinstance(a, torch.Tensor) else b if isinstance(b, torch.Tensor) else None
        if like is None:
            like = torch.empty((), dtype=torch.float32, device=t.device)
        return torch.where(cond, _as_tensor(a, like), _as_tensor(b, like))
    return _cute_where(cond, a, b)


def _cute_round_to(x: Any, dtype: torch.dtype) -> Any:
    import cutlass

    narrow = {
        torch.bfloat16: cutlass.BFloat16,
        torch.float16: cutlass.Float16,
        torch.float32: cutlass.Float32,
    }[dtype]
    own = x.dtype if isinstance(x, _cute().TensorSSA) else type(x)
    return x if own is narrow else x.to(narrow).to(own)


def round_to(x: Any, dtype: torch.dtype = torch.bfloat16) -> Any:
    """x rounded to the nearest value of the float ``dtype`` (bfloat16, float16, float32),
    returned in x's own dtype: exactly what storing x in ``dtype`` (a ``TileStore``) and
    loading it back (a ``TileLoad``) gives."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"coda.primitives.math.round_to: dtype must be a float dtype; got {dtype}")
    if _backend("round_to", (x,)) == _TORCH:
        return x.to(dtype).to(x.dtype)
    return _cute_round_to(_cute_unary_arg("round_to", x), dtype)
