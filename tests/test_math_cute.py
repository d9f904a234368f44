"""The CuTeDSL backend of ``coda.primitives.math``, checked on the CPU (marker ``compile``).

* Every function of ``__all__`` (and composed / scalar-mixing cases) traces on ``TensorSSA``
  fragments and on ``cutlass.Float32`` scalars inside a ``@cute.kernel``, compiles for
  sm_90a, and its PTX shows the intended lowering (accurate libdevice routines, no fast
  ``tanh/sin/cos/lg2.approx``).
* Host-side ``@cute.jit`` code runs on the CPU, so the same cases are evaluated there on
  CPU tensors and compared with the torch branch. This checks the formulas and semantics
  (thresholds, NaN/inf, where, broadcasting, scalar promotion); the host lowering of the
  MLIR ``math`` ops is not the GPU's libdevice, so device accuracy is checked by
  ``tests/test_math_cute_gpu.py``. ``erf`` has no host lowering (``math.erf`` has no LLVM
  translation on the host) and is compiled here but evaluated only on the GPU.

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

from coda.primitives import math as cm
from coda.primitives import ops
from coda.runtime.cute_env import ensure_arch

ensure_arch()

UNARY = tuple(n for n in cm.__all__ if n not in ("maximum", "minimum", "clamp", "where"))


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
    "where": lambda x, y, s: cm.where(x > y, x, y),
    "where_leaky": lambda x, y, s: cm.where(x > 0, x, 0.1 * x),
    "where_numbers": lambda x, y, s: cm.where(x > 0, 1.0, -1),
    "where_scalar_value": lambda x, y, s: cm.where(x > s, s, x),
    "where_scalar_cond": lambda x, y, s: cm.where(s > 0.0, x, y),
    "where_scalar_cond_number": lambda x, y, s: cm.where(s < 0.0, 2.5, y),
    "swiglu": lambda x, y, s: cm.silu(x) * y,
    "swiglu_backward_dg": lambda x, y, s: ops.swiglu_backward(x, y, s)[0],
    "rope_x": lambda x, y, s: ops.rope(x, y, s, 0.5)[0],
    "mix_scalar": lambda x, y, s: cm.sigmoid(s) * x + 2.0,
    "mix_scalar_math": lambda x, y, s: cm.exp(s) + cm.tanh(x * s - 1.5),
    "softplus_neg": lambda x, y, s: cm.softplus(-x) - 0.5 * cm.abs(y),
    "log_sqrt_chain": lambda x, y, s: cm.log(cm.sqrt(cm.abs(x) + 1.0)) + cm.rsqrt(1.0 + y * y),
}
#: the runtime scalar ``s`` takes each of these values
SCALARS = (0.75, -1.5)

#: x edge values (y stays finite): signed zeros, denormals, the softplus threshold, exp
#: overflow/underflow, large angles (libdevice's slow sin/cos path is |x| > 105615), inf, nan
EDGES = [0.0, -0.0, 1e-30, -1e-30, 1e-40, -1e-40, 1e-7, -1e-7, 1.0, -1.0, 0.5, -0.5]
EDGES += [19.99, 20.0, 20.01, -20.0, 30.0, -30.0, 87.0, -87.0, 88.5, -88.5, 89.0, -89.0]
EDGES += [100.0, -100.0, 104.0, -104.0, 1e4, -1e4, 1e5, -1e5, 2e5, -3e6, 1e30, -1e30]
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


def compile_kernel(names, dump_dir, stream=None, tensors=None):
    """cute.compile the kernel of ``build_kernel`` (fake tensors of symbolic size unless
    ``tensors`` are given); returns the compiled function."""
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
        options=f"--keep-ptx --gpu-arch sm_90a --dump-dir {dump_dir}",
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
        ("div.rn.f32", "silu: IEEE division x / (1 + exp(-x))"),
        ("rcp.rn.f32", "sigmoid: IEEE reciprocal 1 / (1 + exp(-x))"),
        ("abs.f32", "abs"),
        ("copysign.f32", "tanh / erf (libdevice)"),
        ("selp.f32", "where / max / min"),
    ],
)
def test_ptx_has(ptx, instruction, why):
    assert instruction in ptx, why


@pytest.mark.compile
@pytest.mark.parametrize("instruction", ["tanh.approx", "sin.approx", "cos.approx", "lg2.approx"])
def test_ptx_avoids_inaccurate_fast_intrinsics(ptx, instruction):
    assert instruction not in ptx


# ---- host code: evaluate on the CPU, compare with the torch branch ---------------------

HOST_CASES = [n for n in CASES if n != "erf"]  # math.erf has no host LLVM lowering
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
    ref = torch_reference(name, x, y, s, torch.float32)
    # Host lowering of the math ops is LLVM's / libm's, not libdevice: a few ulp (its
    # log1p flushes |x| < ~1e-8 to 0, hence the absolute tolerance).
    torch.testing.assert_close(vec, ref, rtol=2e-6, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(scal, ref[:N_HOST_SCALAR], rtol=2e-6, atol=1e-6, equal_nan=True)
