"""GPU numerics of the CuTeDSL backend of ``coda.primitives.math`` (marker ``gpu``; skipped
without a Hopper GPU).

One kernel applies every case of ``tests/test_math_cute.py::CASES`` (every function of
``__all__``, composed and scalar-mixing cases) to 64K fp32 inputs, random and edge values,
on ``TensorSSA`` fragments and on ``Float32`` scalars, and each result is compared with the
torch branch evaluated in float64 on the same fp32 inputs and rounded to fp32: relative
2e-6 + absolute 1e-6, NaN where torch has NaN (and for sin/cos where |x| is past their
range, ~3.29e6: ``test_math_cute.expected``), the same infinities. Only ``FAST_CASES``
(``exp_fast`` and what is built on it: ex2.approx of the rounded x log2 e) need a looser
tolerance, a relative one growing with |x| (``assert_fast_close``), and the cases of
``sin_fast`` / ``cos_fast`` (sin / cos.approx after the same reduction) and of
``sin_fast_of_product`` / ``cos_fast_of_product`` (the same of an exact product, against
sin / cos of the float64 product) an absolute 2e-6 (``FAST_SINCOS_TOL``): every other
transcendental is the accurate libdevice routine (a few ulp;
see the module doc of ``coda.primitives.math``); sin/cos, coda's own Cody-Waite reduction
and Cephes polynomials, are within ~1e-7 absolute up to |x| ~ 8.2e5 and ~7e-7 up to the
range end (float32 emulation, ``tests/test_math_cute.py``), inside the absolute 1e-6; and
the absolute term covers the results that fp32 evaluation cannot get relatively right
(cancellation in gelu_tanh's 1 + tanh near -1, sin/cos near their zeros, underflow of
exp/sigmoid/silu/softplus into denormals, which the ftz exp2 core of libdevice's expf
flushes to zero). sin/cos are also compared with their float32 emulation: bit for bit.
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

from _hopper import require_hopper  # noqa: E402

require_hopper()

from test_math_cute import (  # noqa: E402
    CASES,
    PRODUCT_CASES,
    SCALARS,
    SINCOS_CASES,
    compile_kernel,
    expected,
    inputs,
    sincos_emulated,
)

N = 1 << 16


@pytest.fixture(scope="module")
def device_results(tmp_path_factory):
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass.cute.runtime import from_dlpack

    names = list(CASES)
    x, y = inputs(N, seed=2)
    out = torch.full((2 * len(names), N), -7.0, device="cuda").t()  # columns contiguous
    tensors = [from_dlpack(t, assumed_align=16) for t in (x.cuda(), y.cuda(), out)]
    stream = cuda.CUstream(torch.cuda.current_stream(out.device).cuda_stream)
    f = compile_kernel(names, tmp_path_factory.mktemp("math_gpu"), stream, tensors)
    results = {}
    for s in SCALARS:
        out.fill_(-7.0)
        f(*tensors, cutlass.Float32(s), stream)
        torch.cuda.synchronize()
        host = out.cpu()
        for k, name in enumerate(names):
            results[name, s] = (host[:, k], host[:, len(names) + k])
    return x, y, results


#: cases built on ``exp_fast`` (ex2.approx of the rounded x log2 e): relative error up to
#: |x| 2^-24 more than the accurate exp's, so their relative tolerance grows with |x|
FAST_CASES = ("exp_fast", "sigmoid_fast", "silu_fast", "swiglu_backward_dg")
#: cases built on ``sin_fast`` / ``cos_fast`` (sin / cos.approx on [-pi, pi]: ~5e-7
#: absolute): 2e-6 absolute, scaled by what multiplies them (RoPE: |x| + |y|)
FAST_SINCOS_TOL = {"sin_fast": False, "cos_fast": False, "rope_x": True}
#: ... and of an exact product (the float64 reference takes the exact product too: an fp32
#: product would be off by up to |x y| 2^-24 rad, far past 2e-6 at these angles)
FAST_SINCOS_TOL |= {name: False for name in PRODUCT_CASES}


def assert_fast_close(got, ref, x):
    """|got - ref| <= 1e-6 + (2e-6 + |x| 2^-23) |ref|, the same NaN and infinities."""
    same = (got.isnan() & ref.isnan()) | (got == ref)  # NaN, infinities, exact
    # |x| capped: x = +-inf gives 0 or inf results (equal above), not an inf * 0 tolerance
    tol = 1e-6 + (2e-6 + x.abs().clamp(max=1e30).double() * 2.0**-23) * ref.abs().double()
    err = (got.double() - ref.double()).abs()
    ok = same | (err <= tol)
    assert ok.all(), (x[~ok][:8], got[~ok][:8], ref[~ok][:8])


@pytest.mark.parametrize("s", SCALARS)
@pytest.mark.parametrize("name", list(CASES))
def test_device_cute_matches_torch_branch(device_results, name, s):
    x, y, results = device_results
    vec, scal = results[name, s]
    ref = expected(name, x, y, s, torch.float64)
    if name in FAST_CASES:
        assert_fast_close(vec, ref, x)
        assert_fast_close(scal, ref, x)
        return
    if name in FAST_SINCOS_TOL:
        scale = (x.abs() + y.abs()).double() if FAST_SINCOS_TOL[name] else 1.0
        for got in (vec, scal):
            err = (got.double() - ref.double()).abs()
            ok = (got.isnan() & ref.isnan()) | (got == ref)
            ok |= err <= 2e-6 * scale + 2e-6 * ref.abs().double()
            assert ok.all(), (x[~ok][:8], got[~ok][:8], ref[~ok][:8])
        return
    torch.testing.assert_close(vec, ref, rtol=2e-6, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(scal, ref, rtol=2e-6, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("name", list(SINCOS_CASES))
def test_device_sincos_match_emulation(device_results, name):
    """The GPU runs exactly the emulated float32 steps (fma.rn, cvt.rni, mul.f32 without
    .ftz are IEEE operations): the same bits, so the emulation's accuracy results (measured
    on the CPU in tests/test_math_cute.py) are the kernel's."""
    x, _, results = device_results
    emu = sincos_emulated(x, SINCOS_CASES[name])
    for got in results[name, SCALARS[0]]:  # (fragment path, scalar path)
        same = (got.view(torch.int32) == emu.view(torch.int32)) | (got.isnan() & emu.isnan())
        assert same.all(), (x[~same][:8], got[~same][:8], emu[~same][:8])


@pytest.mark.parametrize("name", ["sigmoid", "silu"])
def test_sigmoid_silu_ulp(device_results, name):
    """sigmoid/silu use rcp.approx.f32 (<= 1 ulp) instead of IEEE division: their error,
    in ulp of the correctly rounded result (normal results only), stays within 4."""
    x, y, results = device_results
    vec, scal = results[name, SCALARS[0]]
    ref = expected(name, x, y, SCALARS[0], torch.float64)
    ok = torch.isfinite(ref) & (ref.abs() > 1e-30)
    r32 = ref[ok].float()
    ulp = (torch.nextafter(r32.abs(), torch.tensor(float("inf"))) - r32.abs()).double()
    for got in (vec, scal):
        err = ((got[ok].double() - ref[ok].double()).abs() / ulp).max().item()
        print(f"{name}: max {err:.2f} ulp")
        assert err <= 4.0, err
