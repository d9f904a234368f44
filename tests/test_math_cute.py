"""The CuTeDSL backend of ``coda.primitives.math``, checked on the CPU (marker ``compile``).

* Every function of ``__all__`` (and composed / scalar-mixing cases) traces on ``TensorSSA``
  fragments and on ``cutlass.Float32`` scalars inside a ``@cute.kernel``, compiles for
  sm_90a, and its PTX shows the intended lowering (accurate libdevice routines, no fast
  ``tanh/sin/cos/lg2.approx``; sin/cos are coda's own register-only code: no local memory).
* sin/cos: a float32 emulation of their exact steps (sharing math.py's constants) is compared
  with float64 sin/cos over a dense grid and edge values, and bit for bit with the CuTeDSL
  code run on the host.
* Host-side ``@cute.jit`` code runs on the CPU, so the same cases are evaluated there on
  CPU tensors and compared with the torch branch. This checks the formulas and semantics
  (thresholds, NaN/inf, where, broadcasting, scalar promotion); the host lowering of the
  MLIR ``math`` ops is not the GPU's libdevice, so device accuracy is checked by
  ``tests/test_math_cute_gpu.py``. ``erf`` has no host lowering (``math.erf`` has no LLVM
  translation on the host) and is compiled here but evaluated only on the GPU; so is
  ``round_to`` (the host JIT lacks compiler-rt's bf16 truncation ``__truncsfbf2``).

``CASES`` is shared with the GPU test: each case is ``fn(x, y, s)`` with ``x``, ``y`` two
fp32 values (fragments or scalars) and ``s`` a scalar (a runtime ``Float32`` kernel argument
on CuTeDSL, a 0-d tensor on torch).
"""

import importlib.util
import math
import subprocess
import sys
import textwrap

import pytest
import torch

from coda.mainloop.cute_env import ensure_arch
from coda.primitives import math as cm
from coda.primitives import ops

ensure_arch()

#: functions of two arguments (their cases are written out below)
BINARY = (
    "maximum",
    "minimum",
    "clamp",
    "where",
    "exp_diff",
    "sin_fast_of_product",
    "cos_fast_of_product",
)
UNARY = tuple(n for n in cm.__all__ if n not in BINARY)


def _unary_case(name):
    f = getattr(cm, name)
    return lambda x, y, s: f(x)


CASES = {
    **{name: _unary_case(name) for name in UNARY},
    "maximum": lambda x, y, s: cm.maximum(x, y),
    "minimum": lambda x, y, s: cm.minimum(x, y),
    "maximum_float": lambda x, y, s: cm.maximum(x, 0.25),
    "minimum_float_first": lambda x, y, s: cm.minimum(-0.5, x),
    "maximum_int": lambda x, y, s: cm.maximum(x, 0),
    "maximum_scalar": lambda x, y, s: cm.maximum(x, s),
    "minimum_scalar_first": lambda x, y, s: cm.minimum(s, x),
    "clamp": lambda x, y, s: cm.clamp(x, -1.0, 0.5),
    "clamp_int": lambda x, y, s: cm.clamp(x, -2, 1),
    "clamp_empty": lambda x, y, s: cm.clamp(x, 1.0, -1.0),  # lo > hi: hi, as torch
    # softmax-like: the first argument at most the second (as a row max or lse is)
    "exp_diff": lambda x, y, s: cm.exp_diff(cm.minimum(x, y), cm.maximum(x, y)),
    "exp_diff_scalar": lambda x, y, s: cm.exp_diff(cm.minimum(x, s), s),
    "where": lambda x, y, s: cm.where(x > y, x, y),
    "where_leaky": lambda x, y, s: cm.where(x > 0, x, 0.1 * x),
    "where_numbers": lambda x, y, s: cm.where(x > 0, 1.0, -1),
    "where_scalar_value": lambda x, y, s: cm.where(x > s, s, x),
    "where_scalar_cond": lambda x, y, s: cm.where(s > 0.0, x, y),
    "where_scalar_cond_number": lambda x, y, s: cm.where(s < 0.0, 2.5, y),
    "swiglu": lambda x, y, s: cm.silu(x) * y,
    "swiglu_backward_dg": lambda x, y, s: ops.swiglu_backward(x, y, s)[0],
    "rope_x": lambda x, y, s: ops.rope(x, y, s, 0.5)[0],
    # angles of every size: x up to past the range (3.3e6 and beyond), y ~ N(0, 1)
    "sin_fast_of_product": lambda x, y, s: cm.sin_fast_of_product(x, y),
    "cos_fast_of_product": lambda x, y, s: cm.cos_fast_of_product(x, y),
    "cos_fast_of_product_scalar": lambda x, y, s: cm.cos_fast_of_product(s, x),
    "mix_scalar": lambda x, y, s: cm.sigmoid(s) * x + 2.0,
    "mix_scalar_math": lambda x, y, s: cm.exp(s) + cm.tanh(x * s - 1.5),
    "softplus_neg": lambda x, y, s: cm.softplus(-x) - 0.5 * cm.abs(y),
    "log_sqrt_chain": lambda x, y, s: cm.log(cm.sqrt(cm.abs(x) + 1.0)) + cm.rsqrt(1.0 + y * y),
}
#: the runtime scalar ``s`` takes each of these values
SCALARS = (0.75, -1.5)

#: x edge values (y stays finite): signed zeros, denormals, the softplus threshold, exp
#: overflow/underflow, large angles (sin/cos: accurate to ~1e-7 up to |x| ~ 8.2e5, to ~7e-7
#: up to 2^21 pi/2 ~ 3.29e6, NaN beyond: see ``expected``), inf, nan
EDGES = [0.0, -0.0, 1e-30, -1e-30, 1e-40, -1e-40, 1e-7, -1e-7, 1.0, -1.0, 0.5, -0.5]
EDGES += [19.99, 20.0, 20.01, -20.0, 30.0, -30.0, 87.0, -87.0, 88.5, -88.5, 89.0, -89.0]
EDGES += [100.0, -100.0, 104.0, -104.0, 1e4, -1e4, 1e5, -1e5, 2e5, -3e6, 1e30, -1e30]
EDGES += [8.2e5, -1.6e6, 3.2e6, 3.3e6, -3.3e6]
EDGES += [math.inf, -math.inf, math.nan]


def inputs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x: edge values then random (normal * 4 and a wider log-uniform spread), y: normal."""
    g = torch.Generator().manual_seed(seed)
    edges = torch.tensor(EDGES, dtype=torch.float32)
    m = n - len(edges)
    wide = torch.exp(torch.empty(m // 4).uniform_(-8, 8, generator=g)) * torch.sign(
        torch.randn(m // 4, generator=g)
    )
    x = torch.cat([edges, torch.randn(m - m // 4, generator=g) * 4, wide])
    y = torch.randn(n, generator=g)
    return x, y


def torch_reference(name: str, x: torch.Tensor, y: torch.Tensor, s: float, dtype) -> torch.Tensor:
    """The torch branch on the same inputs, evaluated in ``dtype``, returned as fp32."""
    fn = CASES[name]
    out = fn(x.to(dtype), y.to(dtype), torch.tensor(s, dtype=dtype))
    return torch.broadcast_to(torch.as_tensor(out), x.shape).float()


#: cases computed by coda's own sin/cos on the CuTeDSL side: NaN where |x| is beyond the
#: reduction's range, |fp32(x * 2/pi)| > 2^21 (|x| > ~3.29e6), where torch is still accurate
SINCOS_CASES = {"sin": False, "cos": True}  # name -> is cos
#: sin / cos.approx after the same reduction: NaN past the same range as sin / cos
FAST_SINCOS_CASES = ("sin_fast", "cos_fast")
#: the same of an exact product: NaN where the fp32 product is past that range
PRODUCT_CASES = {
    "sin_fast_of_product": lambda x, y, s: x.float() * y.float(),
    "cos_fast_of_product": lambda x, y, s: x.float() * y.float(),
    "cos_fast_of_product_scalar": lambda x, y, s: torch.tensor(s, dtype=torch.float32) * x.float(),
}


def sincos_in_range(x: torch.Tensor) -> torch.Tensor:
    """Where the CuTeDSL sin/cos give a number (finite x with |x| <= ~2^21 pi/2)."""
    quarter_turns = x.float() * _f32(cm._SINCOS_TWO_OVER_PI)  # fp32 product, as the kernel
    return quarter_turns.abs() <= cm._SINCOS_MAX_QUARTER_TURNS


def expected(name: str, x: torch.Tensor, y: torch.Tensor, s: float, dtype) -> torch.Tensor:
    """What the CuTeDSL case should give: ``torch_reference``, NaN where sin/cos of x are
    out of range."""
    ref = torch_reference(name, x, y, s, dtype)
    if name in SINCOS_CASES or name in FAST_SINCOS_CASES:
        ref = torch.where(sincos_in_range(x), ref, torch.nan)
    if name in PRODUCT_CASES:
        ref = torch.where(sincos_in_range(PRODUCT_CASES[name](x, y, s)), ref, torch.nan)
    return ref


# ---- sin / cos: float32 emulation of the CuTeDSL algorithm -----------------------------


def _f32(c: float) -> float:
    """A Python float rounded to fp32 (as CuTeDSL rounds a constant to a Float32)."""
    return float(torch.tensor(c, dtype=torch.float32))


def _fma32(a: torch.Tensor, b, c) -> torch.Tensor:
    """fp32 fma(a, b, c) = a * b + c rounded once, exactly as ``fma.rn.f32``: the product of
    two fp32 values is exact in float64; the float64 sum is rounded to odd (its last bit set
    when inexact, from the exact error of the sum), which makes the final rounding to fp32
    correct (no double rounding: float64 has more than 24 + 1 bits)."""
    b = b.double() if isinstance(b, torch.Tensor) else _f32(b)
    c = c.double() if isinstance(c, torch.Tensor) else _f32(c)
    p = a.double() * b  # exact
    s = p + c
    bv = s - p  # TwoSum: p + c = s + err exactly
    err = (p - (s - bv)) + (c - bv)
    odd = (s.view(torch.int64) & 1) == 1
    toward_exact = torch.nextafter(s, torch.where(err > 0, math.inf, -math.inf).double())
    return torch.where((err == 0) | odd | ~torch.isfinite(s), s, toward_exact).float()


def _horner32(z: torch.Tensor, coeffs) -> torch.Tensor:
    p = torch.full_like(z, _f32(coeffs[0]))
    for c in coeffs[1:]:
        p = _fma32(p, z, c)
    return p


def sincos_emulated(x: torch.Tensor, cos: bool) -> torch.Tensor:
    """coda's CuTeDSL sin (cos=False) or cos of fp32 ``x``, step by step in float32 with the
    constants of ``coda.primitives.math`` (see ``_cute_sincos``)."""
    x = x.float()
    quarter_turns = x * _f32(cm._SINCOS_TWO_OVER_PI)
    j = torch.round(quarter_turns)  # round half to even, as cvt.rni.f32.f32
    r = _fma32(-j, cm._SINCOS_PIO2_C1, x)
    r = _fma32(-j, cm._SINCOS_PIO2_C2, r)
    r = _fma32(-j, cm._SINCOS_PIO2_C3, r)
    z = r * r
    sin_r = _fma32(r * z, _horner32(z, cm._SIN_COEFFS), r)
    cos_r = _fma32(_horner32(z, (*cm._COS_COEFFS, -0.5)), z, 1.0)
    q = torch.nan_to_num(j, nan=0.0, posinf=0.0, neginf=0.0).to(torch.int64) + int(cos)
    value = torch.where(q & 1 != 0, cos_r, sin_r)
    value = torch.where(q & 2 != 0, -value, value)
    value = torch.where(quarter_turns.abs() <= cm._SINCOS_MAX_QUARTER_TURNS, value, torch.nan)
    if not cos:
        value = torch.where(x == 0, x, value)  # sin(-0) = -0
    return value


#: pi to 110 significant digits (any long decimal expansion will do)
PI_DIGITS = (
    "3.14159265358979323846264338327950288419716939937510582097494459230781640628620899862803"
    "482534211706798214808651"
)


def _round_to_f32(q) -> float:
    """The fp32 value nearest to the rational ``q`` (ties to even), exactly."""
    from fractions import Fraction

    if q == 0:
        return 0.0
    a = abs(q)
    e = a.numerator.bit_length() - a.denominator.bit_length()  # 2^(e-1) < a < 2^(e+1)
    if Fraction(2) ** e > a:
        e -= 1  # now 2^e <= a < 2^(e+1)
    ulp = Fraction(2) ** (e - 23)
    m, rem = divmod(a / ulp, 1)
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and m % 2 == 1):
        m += 1
    return math.copysign(float(m * ulp), q)


def test_sincos_constants_derivation():
    """The literals in math.py are the Cody-Waite split of pi/2 (rounded to nearest from
    exact rational arithmetic on a long decimal of pi), and fp32(2/pi)."""
    from decimal import Decimal
    from fractions import Fraction

    half_pi = Fraction(Decimal(PI_DIGITS)) / 2
    c1 = _round_to_f32(half_pi)
    c2 = _round_to_f32(half_pi - Fraction(c1))
    c3 = _round_to_f32(half_pi - Fraction(c1) - Fraction(c2))
    assert (cm._SINCOS_PIO2_C1, cm._SINCOS_PIO2_C2, cm._SINCOS_PIO2_C3) == (c1, c2, c3)
    assert cm._SINCOS_TWO_OVER_PI == _round_to_f32(1 / half_pi)
    for c in (c1, c2, c3, cm._SINCOS_TWO_OVER_PI):
        assert _f32(c) == c  # exactly representable: the literal is the fp32 constant
    assert abs(half_pi - Fraction(c1) - Fraction(c2) - Fraction(c3)) < Fraction(1, 2**75)


def _sincos_grid() -> torch.Tensor:
    """A dense fp32 grid of [-1e5, 1e5], random values, fp32 multiples of pi/2 and their
    neighbours (where sin or cos is ~0), and edge values."""
    g = torch.Generator().manual_seed(3)
    grid = torch.linspace(-1e5, 1e5, 2_000_001, dtype=torch.float64).float()
    rand = (torch.rand(1_000_000, generator=g, dtype=torch.float64) * 2 - 1) * 1e5
    small = torch.randn(200_000, generator=g) * 2.0
    k = torch.arange(-63_661, 63_662, dtype=torch.float64)
    pio2 = (k * (math.pi / 2)).float()
    near = torch.cat([pio2, torch.nextafter(pio2, pio2 + 1), torch.nextafter(pio2, pio2 - 1)])
    edges = torch.tensor(
        [0.0, -0.0, 1e-45, -1e-45, 1e-40, 1e-30, -1e-7, math.pi / 4, -math.pi / 4, 1e5, -1e5],
        dtype=torch.float32,
    )
    return torch.cat([grid, rand.float(), small, near, edges])


#: |error| bound on [-1e5, 1e5]: 2^-23 ~ 1.19e-7, one fp32 ulp at 1 (two just below 1).
#: The results are <= 1 in magnitude; the Cephes minimax polynomials are within ~4e-8 of
#: sin/cos on [-pi/4, pi/4], their last FMA rounds by <= 2^-25, and the three-FMA reduction
#: leaves r within a few ulp(|r|)/2 <= ~6e-8 (|j| <= 63662: j * 1.1e-23, the error of
#: C1 + C2 + C3, is negligible). Measured: ~7.2e-8.
SINCOS_ABS_BOUND = 2.0**-23


@pytest.mark.parametrize("name", list(SINCOS_CASES))
def test_sincos_emulation_accuracy(name):
    x = _sincos_grid()
    got = sincos_emulated(x, SINCOS_CASES[name])
    exact = getattr(torch, name)(x.double())
    err = (got.double() - exact).abs()
    assert torch.isfinite(got).all()
    assert err.max().item() <= SINCOS_ABS_BOUND, (x[err.argmax()].item(), err.max().item())
    zeros = x == 0  # sin(+-0) = +-0; cos(+-0) = +1
    negative = x[zeros].signbit() if name == "sin" else torch.zeros_like(x[zeros], dtype=bool)
    assert torch.equal(got[zeros].signbit(), negative)


@pytest.mark.parametrize("name", list(SINCOS_CASES))
def test_sincos_emulation_range(name):
    """Past 1e5 the accuracy degrades slowly (rint(x * 2/pi) may pick a neighbouring quarter
    turn, so |r| exceeds pi/4) up to the range end 2^21 pi/2 ~ 3.29e6, beyond which sin/cos
    are NaN, as they are for +-inf and NaN."""
    g = torch.Generator().manual_seed(4)
    limit = cm._SINCOS_MAX_QUARTER_TURNS * math.pi / 2
    mag = torch.exp(
        torch.empty(1_000_000, dtype=torch.float64).uniform_(
            math.log(1e5), math.log(limit), generator=g
        )
    )
    x = torch.cat([mag, -mag]).float()
    x = x[sincos_in_range(x)]  # fp32 rounding may push a few just past the end
    err = sincos_emulated(x, SINCOS_CASES[name]).double() - getattr(torch, name)(x.double())
    assert err.abs().max().item() <= 1e-6  # measured ~7e-7
    up_to_8e5 = x.abs() <= 8.2e5
    assert err[up_to_8e5].abs().max().item() <= SINCOS_ABS_BOUND
    out = torch.tensor(
        [limit * 1.0001, -limit * 1.0001, 1e30, -3.4e38, math.inf, -math.inf, math.nan]
    )
    assert sincos_emulated(out, SINCOS_CASES[name]).isnan().all()


def product_angle_emulated(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The reduced angle that ``sin_fast_of_product`` / ``cos_fast_of_product`` hand to
    sin / cos.approx, step by step in float32 (see ``_cute_sincos_fast_of_product``)."""
    a, b = a.float(), b.float()
    hi = a * b
    lo = _fma32(a, b, -hi)  # a b = hi + lo exactly
    j = torch.round(hi * _f32(cm._SINCOS_TWO_OVER_PI / 4))
    r = _fma32(-j, 4 * cm._SINCOS_PIO2_C1, hi)
    r = _fma32(-j, 4 * cm._SINCOS_PIO2_C2, r)
    r = _fma32(-j, 4 * cm._SINCOS_PIO2_C3, r)
    return r + lo


def test_product_angle_emulation_accuracy():
    """RoPE angles at long context: positions up to 2^20 times Llama 3's frequencies (base
    500000, head dim 128), and wide random products up to the range end. The angle the
    product functions reduce is within 1e-6 rad of the float64 angle modulo 2 pi (what the
    .approx instructions then add is ~5e-7, checked on the GPU), where an fp32 product
    alone is off by up to |angle| 2^-24 (~8e-3 rad at 128k positions: checked here too, so
    the bound means something)."""
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    freq = inv_freq.float()
    g = torch.Generator().manual_seed(7)
    pos = torch.cat([torch.arange(0, 4096), torch.randint(0, 1 << 20, (4096,), generator=g)])
    pos = pos.float()
    wide_a = torch.exp(torch.empty(200_000).uniform_(math.log(1e3), math.log(3e6), generator=g))
    wide_b = torch.empty(200_000).uniform_(-1, 1, generator=g)
    a = torch.cat([pos.repeat_interleave(freq.numel()), wide_a.float()])
    b = torch.cat([freq.repeat(pos.numel()), wide_b.float()])
    keep = sincos_in_range(a * b)
    a, b = a[keep], b[keep]
    exact = a.double() * b.double()  # exact: 24 + 24 bits

    def angle_error(angle: torch.Tensor) -> float:
        """Largest |angle - exact| modulo 2 pi (float64 is exact enough here)."""
        diff = torch.remainder(angle.double() - exact + math.pi, 2 * math.pi) - math.pi
        return diff.abs().max().item()

    assert angle_error(product_angle_emulated(a, b)) <= 1e-6  # measured 2.4e-7
    assert angle_error(a * b) > 1e-3  # the fp32 product alone


# ---- dispatch without a trace -----------------------------------------------------------


def test_import_does_not_import_cutlass():
    path = importlib.util.find_spec("coda.primitives.math").origin
    code = textwrap.dedent(f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("m", {path!r})
        m = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(m)
        assert m.exp.__name__ == "exp"
        bad = sorted(k for k in sys.modules if k.split(".")[0] == "cutlass")
        assert not bad, bad
    """)
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cute_dispatch_errors():
    import cutlass

    with pytest.raises(TypeError, match="cannot mix torch.Tensor and CuTeDSL"):
        cm.maximum(torch.ones(2), cutlass.Float32(1.0))
    with pytest.raises(TypeError, match=r"where: unsupported argument type .*list"):
        cm.where(cutlass.Boolean(True), cutlass.Float32(1.0), [2.0])
    with pytest.raises(TypeError, match="needs at least one torch.Tensor or CuTeDSL"):
        cm.minimum(1.0, 2)


# ---- device code: trace, compile for sm_90a, inspect the PTX ---------------------------

V = 8  # fp32 values per thread


def build_kernel(names):
    """A host ``@cute.jit`` launching a kernel that applies ``CASES[names[k]]`` to each
    thread's 8-element fragments of x and y (TensorSSA path) into column k of Y and, element
    by element on Float32 scalars (scalar path), into column len(names) + k."""
    import cutlass
    import cutlass.cute as cute

    fns = [CASES[n] for n in names]
    k_cases = len(fns)

    @cute.kernel
    def kernel(X: cute.Tensor, Yin: cute.Tensor, Out: cute.Tensor, s: cutlass.Float32):
        tid = cute.arch.block_idx()[0] * cute.arch.block_dim()[0] + cute.arch.thread_idx()[0]
        if tid * V < cute.size(X):
            gx = cute.zipped_divide(X, (V,))[(None, tid)]
            gy = cute.zipped_divide(Yin, (V,))[(None, tid)]
            go = cute.zipped_divide(Out, (V, 1))
            frag = cute.make_rmem_tensor((V,), cutlass.Float32)
            frag.store(gx.load())
            x = frag.load()
            frag.store(gy.load())
            y = frag.load()
            for k in cutlass.range_constexpr(k_cases):
                go[(None, (tid, k))].store(fns[k](x, y, s))
            for i in cutlass.range(V):
                for k in cutlass.range_constexpr(k_cases):
                    go[(None, (tid, k_cases + k))][i] = fns[k](gx[i], gy[i], s)

    @cute.jit
    def launch(X: cute.Tensor, Yin: cute.Tensor, Out: cute.Tensor, s: cutlass.Float32, stream):
        threads = (cute.size(X) + V - 1) // V
        kernel(X, Yin, Out, s).launch(
            grid=[(threads + 127) // 128, 1, 1], block=[128, 1, 1], stream=stream
        )

    return launch


def compile_kernel(names, dump_dir, stream=None, tensors=None, keep_cubin=False):
    """cute.compile the kernel of ``build_kernel`` (fake tensors of symbolic size unless
    ``tensors`` are given); returns the compiled function (``__ptx__``, and ``__cubin__``
    with ``keep_cubin``)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    if tensors is None:
        n = cute.sym_int32(divisibility=V)
        vec = make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=16)
        out = make_fake_compact_tensor(
            cutlass.Float32, (n, 2 * len(names)), stride_order=(0, 1), assumed_align=16
        )
        tensors = (vec, vec, out)
    return cute.compile(
        build_kernel(names),
        *tensors,
        cutlass.Float32(1.0),
        stream if stream is not None else make_fake_stream(),
        options=f"--keep-ptx {'--keep-cubin ' if keep_cubin else ''}--gpu-arch sm_90a "
        f"--dump-dir {dump_dir}",
    )


@pytest.fixture(scope="module")
def ptx(tmp_path_factory):
    f = compile_kernel(list(CASES), tmp_path_factory.mktemp("math_ptx"))
    text = f.__ptx__
    assert text.lstrip().startswith("//") and ".target sm_90a" in text, text[:200]
    return text


@pytest.mark.compile
def test_every_function_compiles_for_sm90a(ptx):
    assert ".entry" in ptx


@pytest.mark.compile
@pytest.mark.parametrize(
    "instruction,why",
    [
        ("ex2.approx", "exp/sigmoid/silu/softplus/tanh: libdevice's range-reduced exp2 core"),
        ("sqrt.rn.f32", "sqrt: IEEE square root"),
        ("rsqrt.approx.f32", "rsqrt"),
        ("rcp.approx.ftz.f32", "sigmoid / silu: reciprocal of 1 + exp(-x), <= 1 ulp"),
        ("abs.f32", "abs"),
        ("copysign.f32", "tanh / erf (libdevice)"),
        ("selp.f32", "where / max / min"),
        ("cvt.rni.f32.f32", "sin/cos: j = rint(x * 2/pi)"),
        ("fma.rn.f32", "sin/cos: Cody-Waite reduction and polynomials"),
    ],
)
def test_ptx_has(ptx, instruction, why):
    assert instruction in ptx, why


@pytest.mark.compile
def test_ptx_uses_no_local_memory(ptx):
    """The fused GEMM kernel must not touch local memory (LDL/STL); no function may bring
    a local array (as libdevice's sinf/cosf did)."""
    assert ".local" not in ptx


@pytest.fixture(scope="module")
def accurate_ptx(tmp_path_factory):
    """The kernel of every case but the ``*_fast`` functions' and the ops built on them."""
    fast = {n for n in CASES if n.endswith("_fast")} | {"rope_x", "swiglu_backward_dg"}
    fast |= set(PRODUCT_CASES)
    f = compile_kernel([n for n in CASES if n not in fast], tmp_path_factory.mktemp("acc_ptx"))
    return f.__ptx__


@pytest.mark.compile
@pytest.mark.parametrize("instruction", ["tanh.approx", "sin.approx", "cos.approx", "lg2.approx"])
def test_ptx_avoids_inaccurate_fast_intrinsics(accurate_ptx, instruction):
    assert instruction not in accurate_ptx


@pytest.mark.compile
@pytest.mark.parametrize("instruction", ["sin.approx", "cos.approx"])
def test_fast_sincos_use_the_approx_instructions(ptx, instruction):
    """sin_fast / cos_fast: the .approx instructions after the reduction (and no other
    function brings them: ``test_ptx_avoids_inaccurate_fast_intrinsics``)."""
    assert instruction in ptx


@pytest.mark.compile
def test_sincos_use_no_local_memory(tmp_path):
    """libdevice's sinf/cosf kept a local array (Payne-Hanek) that became hundreds of
    LDL/STL inside the fused GEMM kernel; coda's sin/cos must use registers only."""
    f = compile_kernel(["sin", "cos", "rope_x"], tmp_path, keep_cubin=True)
    assert ".local" not in f.__ptx__
    from coda.runtime.sass import count_prefix, disassemble, find_nvdisasm, opcode_counts

    if find_nvdisasm() is None:
        pytest.skip("nvdisasm not installed: PTX checked, SASS not")
    ops = opcode_counts(disassemble(f.__cubin__))
    assert count_prefix(ops, "FFMA") > 0, "not the expected SASS"
    assert count_prefix(ops, "LDL") == 0 and count_prefix(ops, "STL") == 0, ops


def _sincos_host_inputs() -> torch.Tensor:
    """8192 fp32 inputs for the host run: edges, a spread over the whole range and past it,
    and fp32 multiples of pi/2."""
    g = torch.Generator().manual_seed(5)
    edges = torch.tensor(EDGES + [1e-45, -1e-45, 3.4e38], dtype=torch.float32)
    n = 8192 - len(edges) - 512
    spread = torch.exp(torch.empty(n, dtype=torch.float64).uniform_(-20, 15.5, generator=g))
    spread *= torch.sign(torch.randn(n, generator=g, dtype=torch.float64))
    pio2 = (torch.arange(-256, 256, dtype=torch.float64) * 997 * (math.pi / 2)).float()
    return torch.cat([edges, spread.float(), pio2])


@pytest.mark.compile
def test_sincos_host_cute_matches_emulation():
    """The CuTeDSL sin/cos run on the host (fma, roundeven and fp32 mul lower to IEEE ops
    there as on the GPU) equal the float32 emulation bit for bit, so the emulation's
    accuracy results hold for the real code."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import from_dlpack

    @cute.jit
    def host(X: cute.Tensor, Out: cute.Tensor):
        for t in cutlass.range(cute.size(X) // V):
            gx = cute.zipped_divide(X, (V,))[(None, t)]
            go = cute.zipped_divide(Out, (V, 1))
            x = gx.load()
            go[(None, (t, 0))].store(cm.sin(x))  # TensorSSA fragments
            go[(None, (t, 1))].store(cm.cos(x))
            for i in cutlass.range_constexpr(V):
                go[(None, (t, 2))][i] = cm.sin(gx[i])  # Float32 scalars
                go[(None, (t, 3))][i] = cm.cos(gx[i])

    x = _sincos_host_inputs()
    out = torch.full((4, x.numel()), -7.0).t()  # column-major: columns contiguous
    host(from_dlpack(x, assumed_align=16), from_dlpack(out, assumed_align=16))
    for col, name in enumerate(["sin", "cos", "sin", "cos"]):
        emu = sincos_emulated(x, SINCOS_CASES[name])
        got = out[:, col]
        assert torch.equal(got.isnan(), ~sincos_in_range(x)), name
        bits_equal = got.view(torch.int32) == emu.view(torch.int32)  # -0.0 != 0.0
        same = bits_equal | (got.isnan() & emu.isnan())
        assert same.all(), (name, x[~same][:8], got[~same][:8], emu[~same][:8])


# ---- host code: evaluate on the CPU, compare with the torch branch ---------------------

# math.erf has no host LLVM lowering; round_to's fp32 -> bf16 truncation needs compiler-rt's
# __truncsfbf2, which the host JIT does not link (both are evaluated on the GPU)
HOST_CASES = [n for n in CASES if n not in ("erf", "round_to")]
N_HOST = 128
N_HOST_SCALAR = 64  # elements that also go through the scalar path


@pytest.fixture(scope="module")
def host_results():
    """Run every host case on CPU tensors: {(name, s): (vector result, scalar result)}."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import from_dlpack

    fns = [CASES[n] for n in HOST_CASES]
    k_cases = len(fns)

    @cute.jit
    def host(X: cute.Tensor, Yin: cute.Tensor, Out: cute.Tensor, s: cutlass.Float32):
        x = X.load()
        y = Yin.load()
        for k in cutlass.range_constexpr(k_cases):
            Out[None, k].store(fns[k](x, y, s))
        for i in cutlass.range(N_HOST_SCALAR):
            for k in cutlass.range_constexpr(k_cases):
                Out[i, k_cases + k] = fns[k](X[i], Yin[i], s)

    x, y = inputs(N_HOST, seed=1)
    out = torch.full((2 * k_cases, N_HOST), -7.0).t()  # column-major: columns contiguous
    args = [from_dlpack(t, assumed_align=16) for t in (x, y, out)]
    compiled = cute.compile(host, *args, cutlass.Float32(SCALARS[0]))
    results = {}
    for s in SCALARS:
        out.fill_(-7.0)
        compiled(*args, cutlass.Float32(s))
        for k, name in enumerate(HOST_CASES):
            results[name, s] = (out[:, k].clone(), out[:N_HOST_SCALAR, k_cases + k].clone())
    return x, y, results


@pytest.mark.compile
@pytest.mark.parametrize("s", SCALARS)
@pytest.mark.parametrize("name", HOST_CASES)
def test_host_cute_matches_torch_branch(host_results, name, s):
    x, y, results = host_results
    vec, scal = results[name, s]
    ref = expected(name, x, y, s, torch.float32)
    # Host lowering of the math ops is LLVM's / libm's, not libdevice: a few ulp (its
    # log1p flushes |x| < ~1e-8 to 0, hence the absolute tolerance).
    torch.testing.assert_close(vec, ref, rtol=2e-6, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(scal, ref[:N_HOST_SCALAR], rtol=2e-6, atol=1e-6, equal_nan=True)
