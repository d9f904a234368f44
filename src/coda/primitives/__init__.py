"""coda.primitives: the epilogue primitives (one kind per module) and the math they use.

* ``Primitive`` (base.py): the contract (dataflow, reference, simulator hooks, trace).
* ``Elementwise`` (elementwise.py): math on values, incl. pairwise over adjacent columns.
* ``VecLoad`` / ``ScalarLoad`` (vecload.py): broadcast row/column vectors and scalars.
* ``TileLoad`` (tileload.py) / ``TileStore`` (tilestore.py): (M, N*width) operands in/out.
* ``TileReduce`` (tilereduce.py): sum / sumsq / max per row or column, as per-tile partials.
* ``StateTransition`` (state.py): ``LogSumExp``, ``SoftmaxEntropy`` and ``TargetSelect``,
  running row states.
* ``OneHot`` (onehot.py): the tile value column == target[row] (cross-entropy backward).
* ``math``: backend-polymorphic functions for ``fn``; ``ops``: ready-made ``fn``s.
* ``context``: ``ReferenceEnv``, ``Tile``, ``Subtile``, what a primitive's methods receive.
"""

from coda.primitives import math, ops
from coda.primitives.base import Primitive, Source
from coda.primitives.context import ReferenceEnv, Subtile, Tile
from coda.primitives.elementwise import Elementwise
from coda.primitives.onehot import OneHot
from coda.primitives.state import LogSumExp, SoftmaxEntropy, StateTransition, TargetSelect
from coda.primitives.tileload import TileLoad
from coda.primitives.tilereduce import TileReduce
from coda.primitives.tilestore import TileStore
from coda.primitives.vecload import ScalarLoad, VecLoad

__all__ = [
    "Elementwise",
    "LogSumExp",
    "SoftmaxEntropy",
    "OneHot",
    "Primitive",
    "ReferenceEnv",
    "ScalarLoad",
    "Source",
    "StateTransition",
    "Subtile",
    "TargetSelect",
    "Tile",
    "TileLoad",
    "TileReduce",
    "TileStore",
    "VecLoad",
    "math",
    "ops",
]
