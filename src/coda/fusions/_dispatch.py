"""coda.fusions._dispatch: the one place where a fusion picks the fused kernel or the reference.

Sits at the bottom of ``coda.fusions``, right above ``coda.runtime``: every fusion calls its
epilogues and GEMMs through these helpers, never ``epi(...)`` / ``coda.gemm`` /
``epi.reference`` directly, so the SAME ``Epilogue`` objects define the GPU path and the
CPU path, and CI (CPU) tests exactly the algebra the GPU runs. The fused kernels run on
a Hopper GPU (``uses_kernels``); on any other device (the CPU, a GPU of another
architecture) the same calls run the reference path there.

* ``uses_kernels(t)``: whether calls on ``t``'s device take the fused kernels (a Hopper
  GPU) rather than the reference path.
* ``run_epilogue(epi, A, B, outputs=None, *, config=None, **tensors)``: on a Hopper GPU
  the fused kernel ``epi(A, B, **tensors)`` (A, B row-major or transposed views;
  ``outputs``: caller buffers it writes its M x N outputs into; ``config``: as
  ``Epilogue.__call__`` takes it); elsewhere ``epi.reference(A, B,
  **tensors)`` (fp32 inside, outputs in their declared dtypes, new tensors). Finalized
  results are under their names either way (the GPU returns per-tile partials only
  when ``outputs`` is given).
* ``run_map(epi, M, N, like, outputs=None, **tensors)``: an epilogue that never reads
  ``acc`` (a pure elementwise/reduction pass over M x N tensors), launched as a GEMM of
  zeros with K = ``MAP_K`` whose kernel runs no mainloop (the engine skips it for an
  epilogue that does not read ``acc``: no A/B loads, no WGMMA); on CUDA ``outputs``
  names caller buffers to write into. Its zero operands (which only give the launch its
  M, N) are slices of one cached, read-only zero buffer per (device, dtype)
  (``_zero_rows``): no allocation or fill per call.
* ``matmul(A, B, out=None, accumulate=False)``: ``A @ B.T`` by ``coda.gemm`` on a Hopper
  GPU, by ``A.float() @ B.float().T`` elsewhere.
* ``cast(t, dtype)``: ``t.to(dtype)``, what a parameter cast for autocast uses
  (``autocast_operands``, ``coda.nn``'s recipes). With ``WIDEN_GRADIENTS`` (on by
  default) its gradient widens back by a map pass on a Hopper GPU (``widen``: TileLoad
  16-bit -> TileStore fp32, the same values) instead of PyTorch's dtype-changing copy,
  which runs its unvectorized kernel (``unrolled_elementwise_kernel``: 4.5 ms of a 1B AMP
  step's GPU time in ``results/kernel_profile_train_amp_h200.json``).
* ``autocast_operands(*names)``: a fusion entry point under ``torch.autocast`` (its
  floating operands cast as autocast casts F.linear's, by ``cast``, the body run with
  autocast off);
  ``autocast_dtype(t)``: autocast's dtype on ``t``'s device, or None;
  ``without_autocast``: a fused op's backward formula, run with autocast off;
  ``register_formula``: a fused op's ``register_autograd``, its formula run that way,
  its gradients refusing second derivatives it does not compute (``_second_order``).
* ``EagerOp(op, impl, setup_context, backward)`` (on ``plain_eager`` and
  ``eager_autograd``): how a fused op skips the dispatcher in plain eager calls. A
  ``torch.library.custom_op`` with a registered autograd formula costs ~0.1-0.4 ms of
  host time per call before its implementation runs (the dispatcher, and
  ``fill_defaults`` reading the op's schema once per argument: 0.42 ms for a
  20-argument op that does nothing, on the H200 machine's host); in eager mode on plain
  tensors the same implementation and formula run through a ``torch.autograd.Function``
  instead, while anything that must see the op (a compiler tracing, fake or functional
  tensors, tensor subclasses, a dispatch mode, functorch transforms, ``opcheck``) calls
  the custom op as before. Each fusion module keeps its custom ops public (``opcheck``,
  ``torch.ops.coda``) and calls them through their ``EagerOp``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from coda.epilogue import Epilogue, run_fused
from coda.fusions._second_order import refusing_second_order
from coda.primitives import TileLoad, TileStore
from coda.runtime.checks import kernels_run_on
from coda.runtime.kept import kept

__all__ = [
    "MAP_K",
    "SIXTEEN_BIT",
    "EagerOp",
    "autocast_dtype",
    "autocast_operands",
    "cast",
    "eager_autograd",
    "map_pass_takes",
    "matmul",
    "plain_eager",
    "register_formula",
    "run_epilogue",
    "run_map",
    "uses_kernels",
    "widen",
    "without_autocast",
    "zero_filled",
]

#: K of the zero GEMM under ``run_map``: the smallest whose 16-bit rows are 16 bytes (TMA).
MAP_K = 8


def uses_kernels(t: torch.Tensor) -> bool:
    """True when work on ``t``'s device runs coda's fused kernels (a Hopper GPU), False
    where it runs the reference path (the CPU, other GPUs)."""
    return kernels_run_on(t.device)


def autocast_dtype(t: torch.Tensor) -> torch.dtype | None:
    """The lower-precision dtype of an enabled ``torch.autocast`` on ``t``'s device type
    (the dtype it casts F.linear's operands to), else None."""
    device = t.device.type
    if device not in ("cuda", "cpu") or not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


#: the smallest gradient (elements) that ``widen`` widens by a map pass. Measured on the
#: H200 (``benchmarks/results/cast_widen_h200.json``): from 2048 x 8192 up the map pass
#: is 1.23-1.69x PyTorch's copy; at 3072 x 2048 and below a call costs ~42 us, the host
#: path's floor, against PyTorch's 16-17 us
WIDEN_MIN_NUMEL = 1 << 24

#: whether ``cast`` widens its gradient by ``widen`` (True, the default) or is plain
#: ``t.to(dtype)`` (False). Tested bit for bit against ``.to`` on the H200
#: (tests/test_cast_gpu.py); the AMP training step of the 1B model with it on and off
#: (``train_step_amp_widen_ab_h200.json``) moved by less than its rounds' spread.
WIDEN_GRADIENTS = True


#: the 16-bit dtypes the fused ops compute in (what autocast casts to for them)
SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def map_pass_takes(t: torch.Tensor, min_numel: int) -> bool:
    """Whether a map pass should run over ``t`` rather than PyTorch: a plain 2-D
    row-major tensor of at least ``min_numel`` elements whose rows the TMA takes in 16
    bits (a multiple of 8 columns, 16-byte aligned), on a Hopper GPU, not while a
    compiler traces (its own kernels run there)."""
    return (
        type(t) is torch.Tensor
        and t.dim() == 2
        and t.numel() >= min_numel
        and t.stride(1) == 1
        and t.stride(0) == t.shape[1]
        and t.shape[1] % 8 == 0
        and t.data_ptr() % 16 == 0
        and uses_kernels(t)
        and not torch.compiler.is_compiling()
    )


@functools.cache
def _widen_epilogue(src: torch.dtype, dst: torch.dtype) -> Epilogue:
    return Epilogue((TileLoad("g", src), TileStore("g", dst, name="wide")))


def widen(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``g.to(dtype)`` for a 16-bit ``g`` and ``dtype`` float32: by a map pass (TileLoad ->
    TileStore: the values exactly, at the map pass's bandwidth) for a 2-D row-major
    tensor of at least ``WIDEN_MIN_NUMEL`` elements on a Hopper GPU whose rows the TMA
    takes (a multiple of 8 columns, 16-byte aligned); by ``g.to(dtype)`` otherwise (and
    under ``torch.compile``, whose own kernels cast at full speed)."""
    if dtype == torch.float32 and g.dtype in SIXTEEN_BIT and map_pass_takes(g, WIDEN_MIN_NUMEL):
        return run_map(_widen_epilogue(g.dtype, dtype), *g.shape, g, g=g)["wide"]
    return g.to(dtype)


class _Cast(torch.autograd.Function):
    """``t.to(dtype)``; the gradient back to ``t``'s dtype by :func:`widen`."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.src = t.dtype
        ctx.set_materialize_grads(False)  # an unused output leaves t.grad None, as .to does
        return t.to(dtype)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        return (None if g is None else widen(g, ctx.src)), None


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` (differentiable), with ``WIDEN_GRADIENTS`` its gradient widened
    back by :func:`widen`: how coda casts a parameter for autocast. Plain ``t.to(dtype)``
    when nothing would differ (the switch off, no grad needed, the same dtype, a
    compiler tracing)."""
    widened = WIDEN_GRADIENTS and t.dtype != dtype and t.requires_grad
    if widened and torch.is_grad_enabled() and not torch.compiler.is_compiling():
        return _Cast.apply(t, dtype)
    return t.to(dtype)


def autocast_operands(*names: str) -> Callable[[Callable], Callable]:
    """Decorator: under an enabled ``torch.autocast`` on the first argument's device, the
    floating tensors among the parameters ``names`` are cast to autocast's dtype (as
    autocast casts F.linear's operands; gradients reach the originals through the casts)
    and the function runs with autocast off (its own fp32 math stays fp32); otherwise
    the call passes through. Positions come from the signature once, at decoration."""

    def decorate(fn: Callable) -> Callable:
        params = list(inspect.signature(fn).parameters)
        where = {name: params.index(name) for name in names}

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            first = args[0] if args else kwargs[params[0]]
            # (not a tensor: the body's own argument checks name it)
            dtype = autocast_dtype(first) if isinstance(first, torch.Tensor) else None
            if dtype is None:
                return fn(*args, **kwargs)
            args = list(args)
            for name, i in where.items():
                if name in kwargs:
                    box, key = kwargs, name
                elif i < len(args):
                    box, key = args, i
                else:
                    continue  # not passed: its default
                t = box[key]
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    box[key] = cast(t, dtype)
            with torch.autocast(first.device.type, enabled=False):
                return fn(*args, **kwargs)

        return call

    return decorate


def without_autocast(fn: Callable) -> Callable:
    """Decorator for a fused op's backward formula: it runs with autocast off. A backward
    over CPU tensors runs on the calling thread, so ``loss.backward()`` called inside a
    ``torch.autocast`` block (which PyTorch advises against, but allows) would cast the
    formula's fp32 math; CUDA backwards run on autograd's device threads, where autocast
    is off anyway."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        on = [d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
        if not on:
            return fn(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            for device in on:
                stack.enter_context(torch.autocast(device, enabled=False))
            return fn(*args, **kwargs)

    return call


def register_formula(
    name: str, backward: Callable[..., Any], setup_context: Callable[..., None]
) -> Callable[..., Any]:
    """``torch.library.register_autograd(name, ...)`` for a fused op, its backward formula
    run with autocast off (``without_autocast``) and its gradients refusing a second
    derivative towards the op's inputs (``refusing_second_order``); returns that
    backward, which the op's ``EagerOp`` runs too. Every fused op registers its formula
    here."""
    backward = refusing_second_order(name, without_autocast(backward))
    torch.library.register_autograd(name, backward, setup_context=setup_context)
    return backward


def run_epilogue(
    epi: Epilogue,
    A: torch.Tensor,
    B: torch.Tensor,
    outputs: dict[str, torch.Tensor] | None = None,
    *,
    config: Any = None,
    **tensors: Any,
) -> dict:
    """``epi`` after acc = A @ B.T: fused on a Hopper GPU (into ``outputs`` where given;
    with ``config``, e.g. ``"gemm"``: the plain GEMM's tile), ``epi.reference`` elsewhere
    (``outputs`` and ``config`` ignored: the reference returns new tensors).

    The kernels load every row / column vector with unit stride; a vector as users and
    autograd hand them over may be a strided or expanded view (the upstream gradient of
    ``loss.sum()`` is one value expanded over the rows, an expanded bias, a column of a
    table), so such a vector is copied here once, for every fusion alike."""
    if uses_kernels(A):  # (an empty or None ``outputs`` and a None ``config`` are the defaults)
        for name, t in tensors.items():
            if type(t) is torch.Tensor and t.dim() == 1 and not t.is_contiguous():
                tensors[name] = t.contiguous()
        return run_fused(epi, A, B, tensors, outputs=outputs, config=config)
    return epi.reference(A, B, **tensors)


def run_map(
    epi: Epilogue,
    M: int,
    N: int,
    like: torch.Tensor,
    outputs: dict[str, torch.Tensor] | None = None,
    **tensors: Any,
) -> dict:
    """Run ``epi`` (which must not read ``acc``) over an (M, N) problem on ``like``'s device,
    with ``like``'s dtype for the (unused) GEMM operands. ``outputs``: on a Hopper GPU,
    caller tensors the kernel writes its M x N outputs into (ignored elsewhere, where the
    reference returns new tensors)."""
    if epi.reads_acc:
        raise ValueError("run_map runs epilogues that do not read acc; this one does")
    A = _zero_rows(M, like)
    B = _zero_rows(N, like)
    return run_epilogue(epi, A, B, outputs, **tensors)


#: (device, dtype) -> a (rows, MAP_K) zero tensor, grown as needed. READ-ONLY: ``run_map``
#: hands out row slices of it as the operands of its zero GEMM (A and B may be the same
#: rows), which only read them; nothing may write into them, and nothing else gets them.
#: (The map epilogues never read acc, so these values could not reach a result anyway.)
_ZEROS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _zero_rows(rows: int, like: torch.Tensor) -> torch.Tensor:
    """(rows, MAP_K) zeros of ``like``'s dtype and device: a contiguous slice of the cached
    buffer (regrown, to at least twice its rows, when too short). A new tensor instead
    for a tensor subclass (fake or functional tensors while tracing: nothing of theirs is
    cached) and under CUDA graph capture (a buffer allocated there holds zeros only once
    the graph replays, and belongs to the graph's memory pool). The cached buffer is made
    outside any private pool (:func:`coda.runtime.kept.kept`: a CUDA graph tree's warm-up
    routes allocations into its pool without capturing)."""
    if type(like) is not torch.Tensor or (
        like.is_cuda and torch.cuda.is_current_stream_capturing()
    ):
        return torch.zeros((rows, MAP_K), dtype=like.dtype, device=like.device)
    key = (like.device, like.dtype)
    buf = _ZEROS.get(key)
    if buf is None or buf.shape[0] < rows:
        size = (max(rows, 2 * (0 if buf is None else buf.shape[0])), MAP_K)
        buf = kept(lambda: torch.zeros(size, dtype=like.dtype, device=like.device), like.device)
        _ZEROS[key] = buf
    return buf[:rows]


def matmul(
    A: torch.Tensor,
    B: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    accumulate: bool = False,
    config: Any = None,
) -> torch.Tensor:
    """``A @ B.T`` (A: (M, K), B: (N, K), each row-major or a transposed view) into a new
    tensor of ``out_dtype`` (default A's), or into ``out`` (``out += A @ B.T`` with
    ``accumulate=True``). fp32 accumulation on both paths. ``config``: the GEMM's
    (Hopper; None: ``coda.gemm``'s heuristic, which the ops keep from splitting K, so
    that their results repeat bit for bit: an explicit split config is the caller's
    choice)."""
    if uses_kernels(A) and 0 not in (*A.shape, B.shape[0]):  # an empty dimension: no launch
        from coda.matmul import gemm_unguarded as gemm

        extra = {"accumulate": True} if accumulate else {}
        if config is not None:
            extra["config"] = config
        return gemm(A, B, out, out_dtype=out_dtype, allow_split=False, **extra)
    product = A.float() @ B.float().T
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs an out tensor to accumulate into")
        return product.to(out_dtype or A.dtype)
    if accumulate:
        out.copy_((out.float() + product).to(out.dtype))
    else:
        out.copy_(product.to(out.dtype))
    return out


def zero_filled(out: Any) -> Any:
    """``out`` (a tensor, or a tuple or list of them, as an op's fake implementation
    makes them) with every tensor filled with zeros: a fused op's answer for a batch
    without tokens (its outputs have no rows; its weight gradients are sums over no
    rows), given without launching anything."""
    if isinstance(out, torch.Tensor):
        return out.zero_()
    return type(out)(t.zero_() for t in out)


def plain_eager(*args: Any) -> bool:
    """Whether a fused op called with ``args`` may run its implementation directly
    (``eager_autograd``) rather than through the dispatcher: no compiler is tracing, no
    ``TorchDispatchMode`` (fake tensors, ``make_fx``, flop counters, ``opcheck``'s
    checks) or functorch transform is active, and every tensor argument is a plain
    ``torch.Tensor`` or an ``nn.Parameter`` (no other subclass: DTensor, fake,
    functional). Then the custom op would run the same implementation with the same
    autograd formula; only its per-call dispatch cost differs."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    return all(type(a) in _PLAIN for a in args if isinstance(a, torch.Tensor))


#: tensor types ``plain_eager`` lets through: a module's weights are ``nn.Parameter``s,
#: which dispatch as plain tensors (no ``__torch_dispatch__``, torch functions disabled)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def eager_autograd(
    name: str,
    impl: Callable[..., Any],
    setup_context: Callable[..., None],
    backward: Callable[..., Any],
) -> type[torch.autograd.Function]:
    """A ``torch.autograd.Function`` named ``name`` running a custom op's implementation
    ``impl`` with the formula registered for it (``setup_context(ctx, inputs, output)``,
    ``backward(ctx, *grads)``, as ``torch.library.register_autograd`` takes them): its
    ``apply(*args)``, with every argument positional (defaults included), is the op's
    eager call without the dispatcher (``plain_eager``). The context is set up inside
    ``forward`` (the Function has no ``setup_context`` of its own, whose ``apply`` would
    bind the arguments with ``inspect.signature`` on every call)."""

    def forward(ctx: Any, *args: Any) -> Any:
        out = impl(*args)
        setup_context(ctx, args, out)
        return out

    return type(
        name,
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward)},
    )


class EagerOp:
    """A fused custom op's eager entry point. ``op``: the ``torch.library`` custom op;
    ``impl``: the function it was made from; ``setup_context`` / ``backward``: the
    formula registered for it (None for an op without one, e.g. a backward op).

    ``EagerOp(...)(*args)`` calls ``op(*args)`` (missing trailing arguments take
    ``impl``'s defaults), except where ``plain_eager(*args)``: then ``impl`` runs
    directly, through ``eager_autograd`` when the op has a formula. An op without one
    runs directly only where autograd would record nothing (no tensor argument requires
    grad, or grad mode is off); otherwise the op itself refuses to be differentiated,
    as it should."""

    def __init__(
        self,
        op: Callable[..., Any],
        impl: Callable[..., Any],
        setup_context: Callable[..., None] | None = None,
        backward: Callable[..., Any] | None = None,
    ) -> None:
        self.op, self.impl = op, impl
        params = list(inspect.signature(impl).parameters.values())
        self.n_args = len(params)
        self.defaults = tuple(p.default for p in params if p.default is not p.empty)
        self.function = None
        if backward is not None:
            name = "Eager_" + getattr(impl, "__name__", "op").strip("_")
            self.function = eager_autograd(name, impl, setup_context, backward)

    def __call__(self, *args: Any) -> Any:
        missing = self.n_args - len(args)
        if missing > 0:
            args = args + self.defaults[len(self.defaults) - missing :]
        if plain_eager(*args):
            if self.function is not None:
                return self.function.apply(*args)
            if not (torch.is_grad_enabled() and _any_requires_grad(args)):
                return self.impl(*args)
        return self.op(*args)


def _any_requires_grad(args: tuple) -> bool:
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
