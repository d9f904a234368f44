"""coda: Transformer epilogues fused into NVIDIA Hopper GEMMs, composed from primitives.

The public API (importing coda never imports CuTeDSL; kernels load lazily, later):

* ``Epilogue``: an ordered, validated chain of primitives after C = A @ B^T, with
  ``reference(A, B, **tensors)`` (whole-tensor eager PyTorch semantics).
* ``simulate(epi, A, B, tile=..., subtile=..., **tensors)``: the CPU tile simulator, the
  executable specification of the fused kernel (per-tile partials, running states).
* The primitives: ``Elementwise``, ``VecLoad``, ``ScalarLoad``, ``TileLoad``, ``TileStore``,
  ``TileReduce``, ``StateTransition`` (``LogSumExp``, ``SoftmaxEntropy``, ``TargetSelect``),
  their base ``Primitive``, and ``math`` / ``ops`` for Elementwise functions (import them by name:
  ``from coda import math, ops``).
* Specs and errors: ``ValueSpec``, ``TensorSpec``, ``EpilogueError`` (build time),
  ``InputError`` (call time) and ``coda.errors`` for the precise subclasses.
* ``gemm(A, B, out=None)``: the PingPong GEMM (``A @ B.T``) on a Hopper GPU, and
  ``GemmConfig``, a launch config it (and ``Epilogue.__call__``) takes; the heuristic and
  the kernel live in ``coda.mainloop`` (CuTeDSL is imported on the first call).
* ``coda.testing`` (imported on demand): hypothesis strategies, tolerance helpers, profiles.
"""

from coda._version import __version__
from coda.epilogue import Epilogue
from coda.errors import EpilogueError, InputError
from coda.geometry import Problem, Tiling
from coda.mainloop import GemmConfig
from coda.matmul import gemm
from coda.primitives import (
    Elementwise,
    LogSumExp,
    Primitive,
    ScalarLoad,
    SoftmaxEntropy,
    StateTransition,
    TargetSelect,
    TileLoad,
    TileReduce,
    TileStore,
    VecLoad,
)
from coda.primitives import math as math  # explicit re-export, kept out of __all__
from coda.primitives import ops as ops
from coda.runtime import epilogue_kernels as _epilogue_kernels  # noqa: F401  (Epilogue's GPU runner)
from coda.simulator import simulate
from coda.specs import TensorSpec, ValueSpec

__all__ = [
    "Elementwise",
    "Epilogue",
    "EpilogueError",
    "GemmConfig",
    "InputError",
    "LogSumExp",
    "SoftmaxEntropy",
    "Primitive",
    "Problem",
    "ScalarLoad",
    "StateTransition",
    "TargetSelect",
    "TensorSpec",
    "TileLoad",
    "TileReduce",
    "TileStore",
    "Tiling",
    "ValueSpec",
    "VecLoad",
    "__version__",
    "gemm",
    "simulate",
]
# ``coda.math`` and ``coda.ops`` are importable (``from coda import math, ops``) but left
# out of ``__all__`` so that ``from coda import *`` never shadows the standard ``math``.
