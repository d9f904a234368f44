"""coda.errors: the exceptions coda raises (a leaf module; every layer imports it).

Two families:

* ``EpilogueError`` (a ``ValueError``): the epilogue itself is wrong. Raised at build
  time, when a primitive is constructed or added to an ``Epilogue``, before any tensor
  exists. Its subclasses name the exact rule that was broken so tests and users can
  catch precisely what they expect.
* ``InputError`` (a ``ValueError``): the epilogue is fine but the tensors passed to
  ``Epilogue.reference`` / ``coda.simulate`` do not fit it (missing or extra names,
  shapes, dtypes, tilings).
"""

from __future__ import annotations

__all__ = [
    "ArityError",
    "BindingConflictError",
    "DuplicateNameError",
    "EpilogueError",
    "InputError",
    "InvalidArgumentError",
    "InvalidNameError",
    "KindError",
    "UnknownValueError",
    "UseBeforeDefinitionError",
    "WidthMismatchError",
]


class EpilogueError(ValueError):
    """An epilogue (or one of its primitives) is invalid; raised at build time."""


class InvalidArgumentError(EpilogueError):
    """A primitive was constructed with an argument outside its domain
    (unknown op, unsupported dtype or width, a non-callable ``fn``...)."""


class InvalidNameError(EpilogueError):
    """A value or tensor name is not a Python identifier, or is reserved."""


class UnknownValueError(EpilogueError):
    """A primitive reads a value that no earlier primitive defines (and none later)."""


class UseBeforeDefinitionError(EpilogueError):
    """A primitive reads a value before the primitive that produces it, or reads a
    finalized output (a reduction/state result, known only after the last tile)."""


class DuplicateNameError(EpilogueError):
    """A value or an output tensor is defined twice, or an output reuses an input's name."""


class BindingConflictError(EpilogueError):
    """Two primitives bind the same input tensor name with different role/dtype/width."""


class WidthMismatchError(EpilogueError):
    """Values of incompatible widths meet (in an Elementwise, or a pairwise split)."""


class KindError(EpilogueError):
    """A value of the wrong kind is used (e.g. storing or reducing a vector value)."""


class ArityError(EpilogueError):
    """An Elementwise ``fn`` cannot take the arguments its ``ins`` produce."""


class InputError(ValueError):
    """Tensors passed at call time do not meet the contract: an epilogue's inputs, or a
    kernel's (dtype, shape, strides, alignment, device). Raised before any launch."""
