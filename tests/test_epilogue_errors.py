"""Every build-time error: its exception type and its message (primitive construction and
``Epilogue`` validation), plus the "no outputs" error at call time."""

from __future__ import annotations

import re

import pytest
import torch

from coda import (
    Elementwise,
    Epilogue,
    EpilogueError,
    LogSumExp,
    TargetSelect,
    TileLoad,
    TileReduce,
    TileStore,
    VecLoad,
    ops,
    simulate,
)
from coda.errors import (
    ArityError,
    BindingConflictError,
    DuplicateNameError,
    InvalidArgumentError,
    InvalidNameError,
    KindError,
    UnknownValueError,
    UseBeforeDefinitionError,
    WidthMismatchError,
)

BF16 = torch.bfloat16


def raises(exc: type[Exception], message: str):
    """pytest.raises matching the *whole* message literally (no regex surprises)."""
    return pytest.raises(exc, match="^" + re.escape(message) + "$")


def test_errors_are_value_errors():
    for exc in (
        UnknownValueError,
        DuplicateNameError,
        BindingConflictError,
        KindError,
        WidthMismatchError,
        UseBeforeDefinitionError,
        ArityError,
        InvalidNameError,
        InvalidArgumentError,
    ):
        assert issubclass(exc, EpilogueError) and issubclass(exc, ValueError)


# ---- unknown names ---------------------------------------------------------------------
def test_unknown_value_with_suggestion():
    with raises(
        UnknownValueError,
        "primitives[1] Elementwise('x' = add(acc, residul)) reads unknown value 'residul'. "
        "Did you mean 'residual'? Values defined before it: acc, residual.",
    ):
        Epilogue().add(TileLoad("residual"), Elementwise("x", ops.add, ins=("acc", "residul")))


def test_unknown_value_without_suggestion():
    with raises(
        UnknownValueError,
        "primitives[0] Elementwise('x' = neg(zzz)) reads unknown value 'zzz'. "
        "Values defined before it: acc.",
    ):
        Epilogue().add(Elementwise("x", ops.neg, ins="zzz"))


def test_reduction_of_a_value_that_does_not_exist():
    epi = Epilogue().add(Elementwise("x", ops.neg))
    with raises(
        UnknownValueError,
        "primitives[1] TileReduce('ss' = sumsq of 'xx' per row) reads unknown value 'xx'. "
        "Did you mean 'x'? Values defined before it: acc, x.",
    ):
        epi.add(TileReduce("ss", of="xx", op="sumsq"))


def test_state_of_a_value_that_does_not_exist():
    with raises(
        UnknownValueError,
        "primitives[0] LogSumExp('lse' of 'logits') reads unknown value 'logits'. "
        "Values defined before it: acc.",
    ):
        Epilogue().add(LogSumExp("lse", of="logits"))


def test_storing_a_value_that_does_not_exist():
    with raises(
        UnknownValueError,
        "primitives[0] TileStore('h') reads unknown value 'h'. Values defined before it: acc.",
    ):
        Epilogue().add(TileStore("h", BF16))


def test_reading_an_output_tensor_instead_of_a_value():
    with raises(
        UnknownValueError,
        "primitives[1] Elementwise('y' = neg(o)) reads 'o', which is an output tensor of "
        "primitives[0] TileStore('acc' -> 'o'), not a value; read the stored value instead.",
    ):
        Epilogue().add(TileStore("acc", BF16, name="o"), Elementwise("y", ops.neg, ins="o"))


# ---- use before definition -------------------------------------------------------------
def test_reading_a_value_before_it_is_produced():
    with raises(
        UseBeforeDefinitionError,
        "primitives[0] Elementwise('y' = neg(x)) reads 'x' before it is produced: it is "
        "defined later, by primitives[1] Elementwise('x' = neg(acc)). Move the producer "
        "before the reader.",
    ):
        Epilogue((Elementwise("y", ops.neg, ins="x"), Elementwise("x", ops.neg)))


def test_reading_a_finalized_reduction_inside_the_epilogue():
    with raises(
        UseBeforeDefinitionError,
        "primitives[1] Elementwise('y' = scale(acc, ss)) reads 'ss', the result of "
        "primitives[0] TileReduce('ss' = sumsq of 'acc' per row): it is finalized after the "
        "last tile, so no primitive of the same epilogue can read it. Pass it to the next "
        "GEMM's epilogue (VecLoad('ss', per='row', dtype=torch.float32)).",
    ):
        Epilogue().add(
            TileReduce("ss", of="acc", op="sumsq"), Elementwise("y", ops.scale, ins=("acc", "ss"))
        )


# ---- duplicates ------------------------------------------------------------------------
def test_duplicate_value():
    with raises(
        DuplicateNameError,
        "primitives[1] Elementwise('x' = tanh(acc)) defines value 'x', which is already "
        "defined by primitives[0] Elementwise('x' = neg(acc)); values are single-assignment, "
        "pick a new name",
    ):
        Epilogue().add(Elementwise("x", ops.neg), Elementwise("x", ops.tanh))


def test_duplicate_load_of_the_same_tensor():
    with raises(
        DuplicateNameError,
        "primitives[1] TileLoad('r', bfloat16) defines value 'r', which is already defined by "
        "primitives[0] TileLoad('r', bfloat16); values are single-assignment, pick a new name",
    ):
        Epilogue().add(TileLoad("r"), TileLoad("r"))


def test_duplicate_output():
    epi = Epilogue().add(Elementwise("x", ops.neg), TileStore("x", BF16))
    with raises(
        DuplicateNameError,
        "primitives[2] TileStore('acc' -> 'x') writes output 'x', which primitives[1] "
        "TileStore('x') already writes; give one a different name (e.g. "
        "TileStore(value, dtype, name=...))",
    ):
        epi.add(TileStore("acc", torch.float32, name="x"))


def test_duplicate_reduction_output():
    with raises(
        DuplicateNameError,
        "primitives[1] LogSumExp('s' of 'acc') writes output 's', which primitives[0] "
        "TileReduce('s' = sum of 'acc' per row) already writes; give one a different name "
        "(e.g. TileStore(value, dtype, name=...))",
    ):
        Epilogue().add(TileReduce("s", of="acc"), LogSumExp("s", of="acc"))


def test_output_named_like_an_input():
    with raises(
        DuplicateNameError,
        "primitives[1] TileStore('acc' -> 'r') writes output 'r', the name of an input "
        "tensor bound by primitives[0] TileLoad('r', bfloat16)",
    ):
        Epilogue().add(TileLoad("r"), TileStore("acc", BF16, name="r"))


def test_input_named_like_an_output():
    with raises(
        DuplicateNameError,
        "primitives[1] TileLoad('r', bfloat16) binds input tensor 'r', but that name is "
        "already an output of primitives[0] TileStore('acc' -> 'r')",
    ):
        Epilogue().add(TileStore("acc", BF16, name="r"), TileLoad("r"))


# ---- binding conflicts (role / dtype / width) -------------------------------------------
def test_tensor_bound_with_two_roles():
    with raises(
        BindingConflictError,
        "tensor 'r' is bound twice with different specs: as tile (M, N) bfloat16 by "
        "primitives[0] TileLoad('r', bfloat16), and as row (M,) float32 by primitives[1] "
        "VecLoad('r', per='row', float32)",
    ):
        Epilogue().add(TileLoad("r"), VecLoad("r", per="row", dtype=torch.float32))


def test_tensor_bound_with_two_dtypes():
    with raises(
        BindingConflictError,
        "tensor 't' is bound twice with different specs: as row (M,) int64 by primitives[0] "
        "TargetSelect('a' = 'acc'[t]), and as row (M,) int32 by primitives[1] "
        "TargetSelect('b' = 'acc'[t])",
    ):
        Epilogue().add(
            TargetSelect("a", "acc", target="t"),
            TargetSelect("b", "acc", target="t", target_dtype=torch.int32),
        )


def test_tensor_shared_with_the_same_spec_is_fine():
    epi = Epilogue().add(TargetSelect("a", "acc", target="t"), TargetSelect("b", "acc", "t"))
    assert [s.name for s in epi.inputs] == ["t"]


def test_tensor_bound_with_two_widths():
    with raises(
        BindingConflictError,
        "tensor 'labels' is bound twice with different specs: as row (M,) int64 by "
        "primitives[0] TargetSelect('a' = 'acc'[labels]), and as col (N,) bfloat16 by "
        "primitives[1] VecLoad('labels', per='col', bfloat16)",
    ):
        Epilogue().add(TargetSelect("a", "acc", target="labels"), VecLoad("labels", per="col"))


# ---- kinds and widths ------------------------------------------------------------------
def test_width_mismatch():
    with raises(
        WidthMismatchError,
        "Elementwise('y' = add(acc, t)): inputs with columns must share one width, got 'acc' "
        "(tile, width 1), 't' (tile, width 2). Row vectors and scalars broadcast; to combine "
        "widths W and W/2 use pairwise='reduce' or 'map'.",
    ):
        Epilogue().add(TileLoad("t", width=2), Elementwise("y", ops.add, ins=("acc", "t")))


def test_width_mismatch_with_a_column_vector():
    with raises(
        WidthMismatchError,
        "Elementwise('y' = mul(acc, g)): inputs with columns must share one width, got 'acc' "
        "(tile, width 1), 'g' (col vector, width 1/2). Row vectors and scalars broadcast; to "
        "combine widths W and W/2 use pairwise='reduce' or 'map'.",
    ):
        Epilogue().add(VecLoad("g", "col", width="1/2"), Elementwise("y", ops.mul, ("acc", "g")))


def test_pairwise_width_out_of_range():
    with raises(
        WidthMismatchError,
        "Elementwise('y' = swiglu(t), pairwise='reduce'): pairwise 'reduce' of width-1/2 "
        "inputs would produce width 1/4; supported widths are 1/2, 1, 2",
    ):
        Epilogue().add(TileLoad("t", width=0.5), Elementwise("y", ops.swiglu, "t", "reduce"))


def test_pairwise_inputs_must_be_w_or_half_w():
    with raises(
        WidthMismatchError,
        "Elementwise('y' = rope(t, u, u), pairwise='map'): pairwise inputs must have the pair "
        "width 2 (split into even/odd columns) or half of it 1 (one per pair); 'u' has "
        "width 1/2",
    ):
        Epilogue().add(
            TileLoad("t", width=2),
            TileLoad("u", width=0.5),
            Elementwise("y", ops.rope, ("t", "u", "u"), "map"),
        )


def test_pairwise_needs_columns():
    with raises(
        KindError,
        "Elementwise('y' = swiglu(g), pairwise='reduce'): pairwise='reduce' needs at least "
        "one tile or col input to split into column pairs; got 'g' (row vector)",
    ):
        Epilogue().add(VecLoad("g", per="row"), Elementwise("y", ops.swiglu, "g", "reduce"))


def test_storing_a_vector():
    with raises(
        KindError,
        "TileStore('g'): 'g' is a col vector, width 1; only tile values can be stored "
        "(combine it with a tile value in an Elementwise first)",
    ):
        Epilogue().add(VecLoad("g", per="col"), TileStore("g"))


def test_reducing_a_vector():
    with raises(
        KindError,
        "TileReduce('s' = max of 'r' per col): 'r' is a row vector; TileReduce reduces tile "
        "values (use an Elementwise to broadcast a vector onto a tile first)",
    ):
        Epilogue().add(VecLoad("r", per="row"), TileReduce("s", of="r", op="max", per="col"))


def test_state_of_a_scalar():
    from coda import ScalarLoad

    with raises(
        KindError,
        "TargetSelect('p' = 's'[target]): 's' is a scalar; state transitions run over the "
        "columns of a tile value",
    ):
        Epilogue().add(ScalarLoad("s"), TargetSelect("p", of="s"))


# ---- arity -----------------------------------------------------------------------------
def test_arity_mismatch():
    with raises(
        ArityError,
        "Elementwise('y' = add(acc)): add(a, b) cannot take the 1 argument(s) that "
        "ins=('acc',) produce: missing a required argument: 'b'",
    ):
        Epilogue().add(Elementwise("y", ops.add))


def test_arity_mismatch_pairwise():
    with raises(
        ArityError,
        "Elementwise('y' = neg(acc), pairwise='reduce'): neg(x) cannot take the 2 argument(s) "
        "that ins=('acc',) produce (pairwise: 'acc' pass even and odd columns): too many "
        "positional arguments",
    ):
        Epilogue().add(Elementwise("y", ops.neg, pairwise="reduce"))


# ---- names and arguments ---------------------------------------------------------------
def test_not_a_primitive():
    with raises(
        TypeError,
        "primitives[1] is int 42; an Epilogue chains coda.primitives.Primitive instances",
    ):
        Epilogue().add(TileLoad("r"), 42)


RESERVED = (
    "(reserved: A, B, acc, check_contents, config, epi, oob_fill, outputs, self, subtile, tile)"
)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: TileLoad("1x"),
            "TileLoad.name must be a Python identifier (it becomes a "
            "keyword argument or a dict key); got '1x'",
        ),
        (
            lambda: VecLoad("class", "row"),
            "VecLoad.name must be a Python identifier (it "
            "becomes a keyword argument or a dict key); got 'class'",
        ),
        (
            lambda: TileLoad("tile"),
            "TileLoad.name 'tile' is reserved " + RESERVED,
        ),
        (
            lambda: Elementwise("acc", ops.neg),
            "Elementwise.out 'acc' is reserved " + RESERVED,
        ),
        (
            lambda: TileStore("acc", name="B"),
            "TileStore.name 'B' is reserved " + RESERVED,
        ),
        (
            lambda: TargetSelect("p", "acc", target="my-labels"),
            "TargetSelect.target must be a "
            "Python identifier (it becomes a keyword argument or a dict key); got 'my-labels'",
        ),
    ],
)
def test_invalid_names(make, message):
    with raises(InvalidNameError, message):
        make()


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: TileLoad("x", width=3),
            "TileLoad.width must be one of 1/2, 1, 2 (relative to N); got 3",
        ),
        (
            lambda: VecLoad("x", "col", width="wide"),
            "VecLoad.width must be one of 1/2, 1, 2 (relative to N); got 'wide'",
        ),
        (
            lambda: VecLoad("x", per="row", width=2),
            "VecLoad('x'): per='row' vectors have one "
            "entry per row; width applies to per='col' vectors only (got width 2)",
        ),
        (lambda: VecLoad("x", per="rows"), "VecLoad.per must be one of 'row', 'col'; got 'rows'"),
        (
            lambda: TileLoad("x", dtype=torch.int8),
            "TileLoad.dtype must be one of "
            "torch.bfloat16, torch.float16, torch.float32; got torch.int8",
        ),
        (
            lambda: TileStore("x", torch.float64),
            "TileStore.dtype must be one of "
            "torch.bfloat16, torch.float16, torch.float32; got torch.float64",
        ),
        (
            lambda: TargetSelect("p", "acc", target_dtype=torch.float32),
            "TargetSelect.target_dtype must be one of torch.int64, torch.int32; got torch.float32",
        ),
        (
            lambda: TileReduce("x", "acc", op="mean"),
            "TileReduce.op must be one of 'sum', 'sumsq', 'max'; got 'mean'",
        ),
        (
            lambda: TileReduce("x", "acc", per="tile"),
            "TileReduce.per must be one of 'row', 'col'; got 'tile'",
        ),
        (
            lambda: TileReduce("x", "acc", post=2.0),
            "TileReduce.post must be callable or None; got 2.0",
        ),
        (lambda: Elementwise("x", 3), "Elementwise.fn must be callable; got 3"),
        (lambda: Elementwise("x", ops.neg, ins=()), "Elementwise.ins must name at least one value"),
        (
            lambda: Elementwise("x", ops.neg, pairwise=True),
            "Elementwise.pairwise must be "
            "False/None, 'reduce' (fn returns one value, output width W/2) or 'map' (fn returns "
            "(even, odd), output width W); got True",
        ),
    ],
)
def test_invalid_arguments(make, message):
    with raises(InvalidArgumentError, message):
        make()


def test_no_outputs():
    A, B = torch.randn(4, 3), torch.randn(5, 3)
    msg = "this epilogue has no outputs: add a TileStore, TileReduce or StateTransition"
    with raises(EpilogueError, msg):
        Epilogue().add(TileLoad("r")).reference(A, B, r=torch.randn(4, 5).bfloat16())
    with raises(EpilogueError, msg):
        simulate(Epilogue(), A, B)


def test_a_failed_add_leaves_the_epilogue_unchanged():
    epi = Epilogue().add(Elementwise("x", ops.neg))
    with pytest.raises(DuplicateNameError):
        epi.add(Elementwise("x", ops.neg))
    assert len(epi) == 1 and list(epi.values) == ["acc", "x"]


# ---- the engine API audit of 2026-11-29: errors that leaked from internals before ------


def test_tilereduce_post_arity_is_checked_when_built():
    with pytest.raises(ArityError, match=r"TileReduce.post is called with 2 argument\(s\)"):
        TileReduce("s", of="acc", post=lambda s: s)
    TileReduce("s", of="acc", post=lambda s, n: s / n)  # the documented form builds


def test_bad_field_types_name_the_field():
    with raises(
        InvalidNameError,
        "Elementwise.ins must be a Python identifier (it becomes a keyword argument or a "
        "dict key); got 3",
    ):
        Elementwise("x", ops.neg, ins=3)
    with raises(
        InvalidArgumentError, "VecLoad.width must be one of 1/2, 1, 2 (relative to N); got 3/10"
    ):
        VecLoad("v", per="col", width=0.3)
    with raises(InvalidArgumentError, "TargetSelect.ignore_index must be an int; got 1.5"):
        TargetSelect("p", "acc", ignore_index=1.5)


def test_simulate_and_reference_refuse_bad_arguments_up_front():
    from coda.errors import InputError

    A, B = torch.randn(6, 8), torch.randn(8, 8)
    epi = Epilogue().add(TileStore("acc", torch.float32))
    with pytest.raises(TypeError, match="simulate: epi must be a coda.Epilogue"):
        simulate([TileStore("acc")], A, B)
    with pytest.raises(TypeError, match="simulate: oob_fill must be a float; got 'x'"):
        simulate(epi, A, B, tile=(8, 8), oob_fill="x")
    with raises(InputError, "acc must be a torch.Tensor; got list"):
        epi.reference(A, B, acc=[[1.0]])
    with raises(InputError, "acc must be (6, 8) on cpu; got (5, 8) on cpu"):
        epi.reference(A, B, acc=torch.randn(5, 8))


def _user_primitive(**overrides):
    """A user-written primitive (docs/write-your-own-primitive.md's shape) whose reads,
    writes or infer are overridden to be wrong."""
    import attrs

    from coda.primitives import Primitive
    from coda.specs import ValueSpec

    @attrs.frozen
    class Twice(Primitive):
        out: str
        of: str = "acc"

        @property
        def reads(self):
            return overrides.get("reads", (self.of,))

        @property
        def writes(self):
            return overrides.get("writes", (self.out,))

        def infer(self, values):
            spec = ValueSpec(self.out, overrides.get("kind", "tile"), values[self.of].width)
            return spec if overrides.get("single") else (spec,)

        def reference(self, env):
            env.values[self.out] = 2 * env.values[self.of]

        def visit(self, sub, state):
            sub.values[self.out] = 2 * sub.values[self.of]

    return Twice


def test_user_primitive_mistakes_are_named():
    with pytest.raises(
        EpilogueError, match=r"reads must be a tuple of value names; got the string 'acc'"
    ):
        Epilogue().add(_user_primitive(reads="acc")("y"), TileStore("y", torch.float32))
    with pytest.raises(EpilogueError, match=r"infer\(\) must return a tuple of ValueSpecs"):
        Epilogue().add(_user_primitive(single=True)("y"), TileStore("y", torch.float32))
    with pytest.raises(InvalidNameError, match="value name 'tile' is reserved"):
        Epilogue().add(_user_primitive()("tile"), TileStore("acc", torch.float32))
    with pytest.raises(TypeError, match="dtype"):
        from coda.specs import TensorSpec

        TensorSpec("x", "tile", "float32")


def test_a_user_primitive_writing_the_wrong_shape_is_named():
    """It declares a row value but writes the whole tile: before, the tile broadcast into
    wrong results downstream."""
    epi = Epilogue().add(
        _user_primitive(kind="row")("y"), TileReduce("s", of="acc"), TileStore("acc", BF16)
    )
    with pytest.raises(
        RuntimeError, match=r"wrote value 'y' as \(6, 8\); its row spec is \(6, 1\)"
    ):
        epi.reference(torch.randn(6, 8), torch.randn(8, 8))


def _silent_primitives():
    """(RowThing, ReadsPartials): user primitives that write no value (their outputs, if
    any, come from ``tensors``); the second binds an input with a partials role."""
    import attrs

    from coda.primitives import Primitive
    from coda.specs import TensorSpec

    @attrs.frozen
    class RowThing(Primitive):
        name: str = "p"
        of: str = "acc"

        @property
        def reads(self):
            return (self.of,)

        @property
        def writes(self):
            return ()

        def infer(self, values):
            return ()

        def reference(self, env):
            pass

        def visit(self, sub, state):
            pass

    class ReadsPartials(RowThing):
        def tensors(self, values):
            return (TensorSpec(self.name, "partials_row", torch.float32),)

    return RowThing, ReadsPartials


def test_a_primitive_writing_no_value_is_labelled_by_its_fields():
    RowThing, _ = _silent_primitives()
    assert RowThing("amax").label == "RowThing(name='amax', of='acc')"


def test_a_transposed_output_is_not_told_to_call_contiguous():
    from coda.errors import InputError
    from coda.runtime.operands import check_output

    out = torch.empty(16, 8, dtype=BF16).t()
    with pytest.raises(InputError, match="writes it in place: pass a row-major tensor") as e:
        check_output(out, 8, 16)
    assert ".contiguous()" not in str(e.value)


def test_a_partials_role_input_is_refused_when_built():
    _, ReadsPartials = _silent_primitives()
    with pytest.raises(EpilogueError, match="per-tile partials are outputs"):
        Epilogue().add(ReadsPartials(), TileStore("acc", BF16))
