"""coda.epilogue: ``Epilogue``, an ordered chain of primitives over named values.

An epilogue runs after C = A @ B^T (A: (M, K), B: (N, K), like an nn.Linear weight) on the
fp32 accumulator ``acc`` (M, N). It is a *value*: an attrs frozen class holding a tuple of
primitives, so two epilogues built the same way are equal and hash the same (the compile
cache key of later issues). ``add`` returns a new Epilogue; the chain is validated on
construction (``coda.dataflow``), so an invalid epilogue never exists::

    epi = (Epilogue()
           .add(TileLoad("residual", torch.bfloat16))
           .add(Elementwise("x", ops.add, ins=("acc", "residual")))
           .add(TileStore("x", torch.bfloat16)))
    out = epi.reference(A, B, residual=r)        # {"x": (M, N) bf16}

``reference`` is the whole-tensor semantics (eager PyTorch, fp32 inside); the tile
simulator ``coda.simulate`` computes the same outputs tile by tile the way the fused
kernel will.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import torch

from coda.binding import bind
from coda.dataflow import Dataflow, analyze
from coda.errors import EpilogueError, InputError
from coda.geometry import Problem, Tiling
from coda.not_differentiable import refuse_out, tied
from coda.primitives.base import Primitive
from coda.primitives.context import ReferenceEnv
from coda.specs import TensorSpec, ValueSpec, dtype_name

__all__ = ["Epilogue", "check_outputs", "run_fused", "set_runner"]

#: Runs an epilogue fused on the GPU; installed by ``coda.runtime.epilogue_kernels`` (the
#: runtime stands above the epilogue and hands it its runner: no import points back up).
_runner: Any = None


def set_runner(runner: Any) -> None:
    """Install the function ``Epilogue.__call__`` delegates to (the GPU runtime does)."""
    global _runner
    _runner = runner


def run_fused(
    epi: Epilogue,
    A: torch.Tensor,
    B: torch.Tensor,
    tensors: Mapping[str, Any],
    *,
    config: Any = None,
    check_contents: bool = False,
    outputs: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """``epi(A, B, **tensors)`` without its autograd guard (the same arguments, the tensors
    as a mapping): its work, and what ops that run epilogues inside their own backward
    formulas call (``coda.fusions``)."""
    if _runner is None:  # `import coda` installs it; only a partial import lacks it
        raise RuntimeError("no GPU runner installed: `import coda` installs it")
    return _runner(
        epi, A, B, tensors, config=config, outputs=outputs, check_contents=check_contents
    )


def _requires_grad(A: Any, B: Any, tensors: Mapping[str, Any]) -> bool:
    """An epilogue call's tensor argument requires grad (read cheaply: this runs on every
    call in grad mode; non-tensors are the checks' to name)."""
    try:
        if A.requires_grad or B.requires_grad:
            return True
    except AttributeError:
        return False
    for t in tensors.values():
        if type(t) is torch.Tensor and t.requires_grad:
            return True
    return False


def _to_primitives(value: Any) -> tuple[Primitive, ...]:
    return tuple(value)


@attrs.frozen(cache_hash=True)
class Epilogue:
    """An ordered, validated chain of primitives (see the module doc)."""

    primitives: tuple[Primitive, ...] = attrs.field(default=(), converter=_to_primitives)
    _flow: Dataflow = attrs.field(init=False, eq=False, hash=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_flow", analyze(self.primitives))

    def add(self, *primitives: Primitive) -> Epilogue:
        """A new Epilogue with ``primitives`` appended (validated now)."""
        return Epilogue(self.primitives + primitives)

    def __len__(self) -> int:
        return len(self.primitives)

    def __iter__(self) -> Iterator[Primitive]:
        return iter(self.primitives)

    # ---- dataflow ----------------------------------------------------------------------
    @property
    def values(self) -> Mapping[str, ValueSpec]:
        """Every value (``acc`` first), in definition order, with its kind and width."""
        return self._flow.values

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        """The tensors a caller passes as keyword arguments, in binding order."""
        return self._flow.inputs

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        """The tensors returned, in order: stores, finalized results and their partials."""
        return self._flow.outputs

    @property
    def reads_acc(self) -> bool:
        """Whether any primitive reads the accumulator ``acc``. One that does not (a map
        pass over M x N tensors) does not depend on A @ B^T: its kernel runs no mainloop."""
        return any("acc" in p.reads for p in self.primitives)

    @property
    def n_alignment(self) -> int:
        """N (and tile/subtile widths) must be multiples of this: 1, or 2/4 when the
        epilogue has half-width values or column pairs."""
        return self._flow.n_alignment

    def bindings(self, index: int) -> tuple[TensorSpec, ...]:
        """The tensors bound by ``primitives[index]``."""
        return self._flow.bindings[index]

    def describe(self) -> str:
        """A readable multi-line listing: primitives, values, inputs, outputs."""
        lines = [f"Epilogue with {len(self.primitives)} primitives:"]
        lines += [f"  [{i}] {p.label}" for i, p in enumerate(self.primitives)]
        lines.append(
            "  values: " + ", ".join(f"{n} ({s.describe()})" for n, s in self.values.items())
        )
        lines.append("  inputs: " + ("; ".join(s.describe() for s in self.inputs) or "none"))
        lines.append("  outputs: " + ("; ".join(s.describe() for s in self.outputs) or "none"))
        return "\n".join(lines)

    # ---- the fused kernel ----------------------------------------------------------------
    def __call__(
        self,
        A: torch.Tensor,
        B: torch.Tensor,
        *,
        config: Any = None,
        check_contents: bool = False,
        outputs: Mapping[str, torch.Tensor] | None = None,
        **tensors: torch.Tensor | float,
    ) -> dict[str, torch.Tensor]:
        """Run fused after the GEMM on a Hopper GPU: acc = A @ B^T, then every primitive in
        the kernel's epilogue. Returns the finalized results and M x N outputs of
        ``reference``; the per-tile partials of reductions are the kernel's scratch (in a
        per-stream workspace), returned only when passed in ``outputs``. Input errors
        (names, shapes, dtypes, strides, devices) are raised before anything is
        launched; compositions
        that cannot be fused yet raise ``NotImplementedError`` (see
        ``coda.runtime.fused.unsupported``). Tensor *values* (e.g. targets in range) are
        checked only with ``check_contents=True``: reading them synchronizes with the GPU.
        Unchecked, a target that is neither a column nor ``ignore_index`` selects 0.
        A and B may each be row-major or a transposed view (see ``coda.gemm``).
        ``outputs`` maps output names to caller-owned tensors to write into (shapes and
        dtypes as declared), e.g. buffers reused across steps or captured in a CUDA graph.
        ``config``: None for the fused heuristic (128 x 128 PingPong tiles, narrower when
        those spill), ``"gemm"`` for the tile ``coda.gemm`` picks for the shape (e.g.
        256-row cooperative tiles on long-running problems; narrower when that spills:
        for light epilogues on long mainloops), or a ``GemmConfig``, run as given. Not
        differentiable (``reference``, made of PyTorch ops, is; ``coda.fusions`` wraps
        epilogues in autograd ops): with grad mode on and an input requiring grad, every
        output requires grad through a node whose backward raises, naming this call, and
        ``outputs=`` is refused at once (``coda.not_differentiable``); under
        ``torch.no_grad()`` the outputs are plain tensors."""
        if torch.is_grad_enabled() and _requires_grad(A, B, tensors):
            if outputs:
                refuse_out("Epilogue call", "outputs=")
            got = run_fused(self, A, B, tensors, config=config, check_contents=check_contents)
            inputs = (A, B, *tensors.values())
            return {name: tied("Epilogue call", t, inputs) for name, t in got.items()}
        if _runner is None:  # run_fused's work, inline: the common call keeps one frame
            raise RuntimeError("no GPU runner installed: `import coda` installs it")
        return _runner(
            self, A, B, tensors, config=config, outputs=outputs, check_contents=check_contents
        )

    # ---- semantics ---------------------------------------------------------------------
    def reference(
        self,
        A: torch.Tensor,
        B: torch.Tensor,
        *,
        tile: tuple[int, int] | None = None,
        acc: torch.Tensor | None = None,
        **tensors: torch.Tensor | float,
    ) -> dict[str, torch.Tensor]:
        """Evaluate on whole tensors in eager PyTorch: acc = A.float() @ B.float().T, then
        every primitive's ``reference`` in order. Returns {output name: tensor} in
        ``outputs`` order. Per-tile partials depend on the tiling, so they are included only
        when ``tile=(tm, tn)`` is given. ``acc`` overrides the accumulator (an (M, N)
        tensor), e.g. float64 for a high-precision truth or a bf16-rounded GEMM output to
        model an unfused eager pipeline."""
        if not self.outputs:
            raise EpilogueError(
                "this epilogue has no outputs: add a TileStore, TileReduce or StateTransition"
            )
        problem = bind(self, A, B, tensors)
        if tile is not None:
            tiling = Tiling(tile)
            tiling.check_alignment(self.n_alignment)
            tile = tiling.tile
        env = ReferenceEnv(problem, self.values, tensors, A.device, tile=tile)
        if acc is not None:
            if not isinstance(acc, torch.Tensor):
                raise InputError(f"acc must be a torch.Tensor; got {type(acc).__name__}")
            if tuple(acc.shape) != (problem.M, problem.N) or acc.device != A.device:
                raise InputError(
                    f"acc must be ({problem.M}, {problem.N}) on {A.device}; got "
                    f"{tuple(acc.shape)} on {acc.device}"
                )
        env.values["acc"] = A.float() @ B.float().T if acc is None else acc
        for p in self.primitives:
            p.reference(env)
            _check_written(p, env)
        wanted = [s for s in self.outputs if tile is not None or not s.is_partials]
        if acc is not None:  # a float64 acc computes in float64: report in declared dtypes
            for spec in wanted:
                if spec.name in env.outputs:
                    env.outputs[spec.name] = env.outputs[spec.name].to(spec.dtype)
        result = check_outputs(env.outputs, wanted, problem, tile, self)
        return _unaliased(result, (A, B, acc, *tensors.values()))


def check_outputs(
    produced: Mapping[str, torch.Tensor],
    wanted: list[TensorSpec],
    problem: Problem,
    tile: tuple[int, int] | None,
    epilogue: Epilogue,
) -> dict[str, torch.Tensor]:
    """The outputs in ``wanted`` order, each checked against its spec (a primitive that
    breaks its own declared shapes/dtypes is a bug worth a loud error)."""
    result: dict[str, torch.Tensor] = {}
    for spec in wanted:
        owner = next(
            p.label for i, p in enumerate(epilogue.primitives) if spec in epilogue.bindings(i)
        )
        if spec.name not in produced:
            raise RuntimeError(f"{owner} declares output {spec.name!r} but did not produce it")
        t = produced[spec.name]
        shape = spec.shape(problem.M, problem.N, tile)
        if tuple(t.shape) != shape or t.dtype != spec.dtype:
            raise RuntimeError(
                f"{owner} produced {spec.name!r} as {tuple(t.shape)} {dtype_name(t.dtype)}; "
                f"its spec says {shape} {dtype_name(spec.dtype)}"
            )
        result[spec.name] = t
    return result


def _unaliased(
    result: dict[str, torch.Tensor], inputs: tuple[object, ...]
) -> dict[str, torch.Tensor]:
    """``result`` with every output that shares memory with an input or an earlier
    output copied (a TileStore of a loaded tile or of acc, two stores of one value, an
    identity chain): the reference returns new tensors, as a PyTorch functional op does
    and as a custom op on the reference path must."""
    seen = {
        t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor) and t.numel()
    }
    for name, t in result.items():
        if not t.numel():
            continue
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = result[name] = t.clone()
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
    return result


def _check_written(p: Primitive, env: ReferenceEnv) -> None:
    """Each value ``p`` writes has its declared kind's shape (a user primitive that
    writes a tile where it declared a row would otherwise broadcast into wrong results)."""
    for name in p.writes:
        t = env.values.get(name)
        if t is None:
            raise RuntimeError(f"{p.label} declares value {name!r} but did not write it")
        want = env.shape(env.specs[name])
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise RuntimeError(
                f"{p.label} wrote value {name!r} as {got}; its {env.specs[name].kind} "
                f"spec is {want} (a bug in {type(p).__name__}.reference)"
            )
