"""Epilogue as a value (equality, hashing: the future cache key), its specs, and the
call-time checks of the tensors passed to reference / simulate (InputError)."""

from __future__ import annotations

import re
import subprocess
import sys
from fractions import Fraction

import pytest
import torch

from coda import (
    Elementwise,
    Epilogue,
    InputError,
    LogSumExp,
    ScalarLoad,
    TensorSpec,
    TileLoad,
    TileReduce,
    TileStore,
    VecLoad,
    ops,
    simulate,
)
from coda.errors import InvalidNameError

BF16, F32 = torch.bfloat16, torch.float32


def rmsnorm_epilogue(eps: float = 1e-6) -> Epilogue:
    return Epilogue().add(
        TileLoad("residual", BF16),
        Elementwise("x", ops.add, ins=("acc", "residual")),
        TileStore("x", BF16),
        VecLoad("gamma", per="col", dtype=BF16),
        Elementwise("h", ops.mul, ins=("x", "gamma")),
        TileStore("h", BF16),
        TileReduce("ss", of="x", op="sumsq"),
    )


def test_epilogues_are_values():
    a, b = rmsnorm_epilogue(), rmsnorm_epilogue()
    assert a == b and hash(a) == hash(b) and a is not b
    assert len({a, b}) == 1
    c = rmsnorm_epilogue().add(TileStore("acc", F32, name="y"))
    assert c != a and len(c) == len(a) + 1 and len(a) == 7  # add returns a new epilogue
    assert Epilogue().add(TileStore("acc", BF16)) != Epilogue().add(TileStore("acc", F32))


def test_lambdas_compare_by_identity():
    f = lambda a: a * 2  # noqa: E731
    g = lambda a: a * 2  # noqa: E731
    assert Elementwise("y", f) == Elementwise("y", f)
    assert Elementwise("y", f) != Elementwise("y", g)  # honest: different code objects


def test_primitives_are_frozen():
    p = TileLoad("r")
    with pytest.raises(AttributeError):
        p.name = "s"  # type: ignore[misc]


def test_specs():
    epi = rmsnorm_epilogue()
    assert [s.name for s in epi.inputs] == ["residual", "gamma"]
    assert epi.inputs[1] == TensorSpec("gamma", "col", BF16)
    assert [(s.name, s.role, s.dtype) for s in epi.outputs] == [
        ("x", "tile", BF16),
        ("h", "tile", BF16),
        ("ss", "row", F32),
        ("ss.partials", "partials_row", F32),
    ]
    assert all(s.direction == "out" for s in epi.outputs)
    assert list(epi.values) == ["acc", "residual", "x", "gamma", "h"]
    assert epi.values["gamma"].kind == "col" and epi.n_alignment == 1
    assert epi.outputs[3].shape(300, 520, (128, 128)) == (300, 5)
    text = epi.describe()
    assert "[6] TileReduce('ss' = sumsq of 'x' per row)" in text
    assert "gamma: col (N,) bfloat16" in text


def test_widths_and_alignment():
    epi = Epilogue().add(
        TileLoad("gu", BF16, width=2),
        Elementwise("y", ops.swiglu, ins="gu", pairwise="reduce"),
        Elementwise("z", ops.swiglu, ins="y", pairwise="reduce"),
        TileStore("z", F32),
        TileReduce("cs", of="z", per="col"),
    )
    assert epi.values["y"].width == 1 and epi.values["z"].width == Fraction(1, 2)
    assert epi.n_alignment == 2
    assert epi.outputs[1].width == Fraction(1, 2) and epi.outputs[1].shape(8, 6) == (3,)
    rope = Epilogue().add(
        Elementwise("h", ops.swiglu, pairwise="reduce"),
        Elementwise("q", lambda e, o: (o, e), ins="h", pairwise="map"),
        TileStore("q", F32),
    )
    assert rope.n_alignment == 4  # pairs of width-1/2 columns: N % 4 == 0


def inputs(M=20, N=12, K=8):
    g = torch.Generator().manual_seed(0)
    A, B = torch.randn(M, K, generator=g).to(BF16), torch.randn(N, K, generator=g).to(BF16)
    return A, B, torch.randn(M, N, generator=g).to(BF16), torch.randn(N, generator=g).to(BF16)


def check(fn, message):
    with pytest.raises(InputError, match="^" + re.escape(message) + "$"):
        fn()


@pytest.mark.parametrize("run", ["reference", "simulate"])
def test_input_errors(run):
    epi = rmsnorm_epilogue()
    A, B, r, g = inputs()

    def call(A=A, B=B, **kw):
        if run == "reference":
            return epi.reference(A, B, **kw)
        return simulate(epi, A, B, tile=(8, 8), **kw)

    check(
        lambda: call(residual=r),
        "missing: gamma: col (N,) bfloat16. This epilogue's inputs: residual, gamma.",
    )
    check(
        lambda: call(residual=r, gamma=g, gama=g),
        "unexpected tensor 'gama' (did you "
        "mean 'gamma'?). This epilogue's inputs: residual, gamma.",
    )
    check(
        lambda: call(residual=r[:, :5], gamma=g),
        "residual: tile (M, N) bfloat16: expected shape (20, 12) for M=20, N=12; got (20, 5)",
    )
    check(
        lambda: call(residual=r.float(), gamma=g),
        "residual: tile (M, N) bfloat16: expected dtype bfloat16; got float32",
    )
    check(lambda: call(residual=r, gamma=3.0), "gamma: col (N,) bfloat16: got float, not a tensor")
    check(
        lambda: call(B=B[:, :3], residual=r, gamma=g),
        "A is (M, K) = (20, 8) and B is "
        "(N, K) = (12, 3) (like an nn.Linear weight): their K must agree (8 != 3)",
    )
    check(
        lambda: call(B=B.half(), residual=r, gamma=g),
        "A and B must have the same dtype; got bfloat16 and float16",
    )
    check(lambda: call(A=A[0], residual=r, gamma=g), "A must be 2-D; got shape (8,)")
    check(
        lambda: call(A=A.long(), residual=r, gamma=g),
        "A must be bfloat16, float16 or float32; got int64",
    )
    check(lambda: call(A="A", residual=r, gamma=g), "A must be a torch.Tensor; got str")


def test_scalar_and_alignment_input_errors():
    A, B, _, _ = inputs(N=10)
    epi = Epilogue().add(
        ScalarLoad("s"), Elementwise("y", ops.scale, ins=("acc", "s")), TileStore("y", F32)
    )
    check(
        lambda: epi.reference(A, B, s=torch.tensor(1.0)),
        "'s' is a scalar argument: pass a Python float; got Tensor",
    )
    assert epi.reference(A, B, s=2)["y"].shape == (20, 10)
    half = Epilogue().add(
        Elementwise("h", ops.swiglu, pairwise="reduce"),
        Elementwise("q", lambda e, o: (o, e), ins="h", pairwise="map"),
        TileStore("q", F32),
    )
    check(
        lambda: half.reference(A, B),
        "this epilogue has half-width values or column "
        "pairs, so N must be a multiple of 4; got N=10",
    )


def test_tiling_errors():
    A, B, r, g = inputs(N=16)
    epi = Epilogue().add(Elementwise("h", ops.swiglu, pairwise="reduce"), TileStore("h", F32))
    check(
        lambda: simulate(epi, A, B, tile=(8, 8), subtile=(3, 8)),
        "subtile (3, 8) must divide tile (8, 8) (sm | tm and sn | tn)",
    )
    check(
        lambda: simulate(epi, A, B, tile=(8, 6), subtile=(8, 3)),
        "this epilogue needs "
        "tile and subtile widths that are multiples of 2 (it has half-width values or "
        "column pairs); got tn=6, sn=3",
    )
    check(lambda: simulate(epi, A, B, tile=(8, 0)), "expected a pair of positive ints, got (8, 0)")


def test_default_subtile_and_reference_without_partials():
    A, B, r, g = inputs(M=130, N=70)
    epi = Epilogue().add(LogSumExp("lse", of="acc"))
    ref = epi.reference(A, B)
    assert list(ref) == ["lse"]
    sim = simulate(epi, A, B)  # tile (128, 128), subtile (64, 32)
    assert sim["lse.partials_max"].shape == (130, 1)
    torch.testing.assert_close(sim["lse"], ref["lse"])


def test_import_coda_does_not_import_cutlass():
    code = "import sys, coda, coda.testing; print('cutlass' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", ["epi", "self", "config", "outputs", "check_contents"])
def test_call_parameter_names_are_reserved(name):
    """A tensor named like a parameter of ``simulate`` / ``reference`` / ``__call__``
    could never be passed as a keyword: refused when the primitive is built."""
    with pytest.raises(InvalidNameError, match=f"{name!r} is reserved"):
        ScalarLoad(name)


def test_reference_outputs_never_alias_inputs_or_each_other():
    """A stored loaded tile, a stored acc given by the caller and two stores of one value
    come back as new tensors (writing one changes nothing else)."""
    A, B = torch.randn(6, 8), torch.randn(8, 8)
    r, acc = torch.randn(6, 8), torch.randn(6, 8)
    out = Epilogue().add(TileLoad("r", F32), TileStore("r", F32, name="o")).reference(A, B, r=r)
    assert torch.equal(out["o"], r)
    out["o"].zero_()
    assert r.abs().sum() > 0
    two = Epilogue().add(TileStore("acc", F32, name="c1"), TileStore("acc", F32, name="c2"))
    out = two.reference(A, B, acc=acc)
    assert torch.equal(out["c1"], acc) and torch.equal(out["c2"], acc)
    ptrs = {t.untyped_storage().data_ptr() for t in (acc, out["c1"], out["c2"])}
    assert len(ptrs) == 3
