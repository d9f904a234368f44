"""coda.primitives._validators: attrs validators/converters shared by the primitive kinds.

They raise ``EpilogueError`` subclasses so a bad primitive fails where it is written.
"""

from __future__ import annotations

import inspect
import numbers
from fractions import Fraction
from typing import Any

import attrs
import torch

from coda.errors import ArityError, InvalidArgumentError
from coda.specs import FLOAT_DTYPES, INDEX_DTYPES, WIDTHS, check_name, dtype_name

__all__ = [
    "float_dtype",
    "arity_mismatch",
    "index_dtype",
    "integer",
    "new_name",
    "one_of",
    "optional_callable_of",
    "read_name",
    "read_names",
    "to_fraction",
    "to_names",
    "width",
]


def new_name(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    """A name this primitive defines (value or tensor): identifier, not reserved."""
    check_name(value, f"{type(inst).__name__}.{attribute.name}")


def read_name(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    """A value name this primitive reads: an identifier ('acc' allowed)."""
    if value != "acc":
        check_name(value, f"{type(inst).__name__}.{attribute.name}")


def to_names(value: Any) -> tuple[str, ...]:
    """Accept one name or an iterable of names."""
    if isinstance(value, str):
        return (value,)
    try:
        return tuple(value)
    except TypeError:  # not iterable: one (bad) name, for the validator to name
        return (value,)


def read_names(inst: Any, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
    if not value:
        raise InvalidArgumentError(
            f"{type(inst).__name__}.{attribute.name} must name at least one value"
        )
    for v in value:
        read_name(inst, attribute, v)


def to_fraction(value: Any) -> Any:
    """Lenient converter: 1, 2, 0.5, "1/2" -> Fraction (anything else left as is for the
    validator to reject with the field's name)."""
    try:  # a float by its shortest repr: 0.3 -> 3/10, not the binary 5404319552844595/2^54
        return Fraction(repr(value)) if isinstance(value, float) else Fraction(value)
    except (TypeError, ValueError):
        return value


def width(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in WIDTHS:
        raise InvalidArgumentError(
            f"{type(inst).__name__}.{attribute.name} must be one of 1/2, 1, 2 (relative to "
            f"N); got {value if isinstance(value, Fraction) else repr(value)}"
        )


def one_of(*choices: Any) -> Any:
    def check(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value not in choices:
            raise InvalidArgumentError(
                f"{type(inst).__name__}.{attribute.name} must be one of "
                f"{', '.join(repr(c) for c in choices)}; got {value!r}"
            )

    return check


def _dtype_check(allowed: tuple[torch.dtype, ...]) -> Any:
    def check(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value not in allowed:
            raise InvalidArgumentError(
                f"{type(inst).__name__}.{attribute.name} must be one of "
                f"{', '.join('torch.' + dtype_name(d) for d in allowed)}; got {value!r}"
            )

    return check


float_dtype = _dtype_check(FLOAT_DTYPES)
index_dtype = _dtype_check(INDEX_DTYPES)


def integer(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    """An int (not a bool, not a float that equals one)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentError(
            f"{type(inst).__name__}.{attribute.name} must be an int; got {value!r}"
        )


def arity_mismatch(fn: Any, n_args: int) -> tuple[str, TypeError] | None:
    """(``fn``'s parameter list, the binding error) when ``fn`` cannot take ``n_args``
    positional arguments; None when it can or its signature cannot be read (builtins)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        sig.bind(*range(n_args))
    except TypeError as e:
        return ", ".join(sig.parameters), e
    return None


def optional_callable_of(n_args: int) -> Any:
    """None, or a callable that takes ``n_args`` positional arguments (checked where its
    signature can be read)."""

    def check(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
        optional_callable(inst, attribute, value)
        if value is None or (mismatch := arity_mismatch(value, n_args)) is None:
            return
        params, e = mismatch
        raise ArityError(
            f"{type(inst).__name__}.{attribute.name} is called with {n_args} "
            f"argument(s); {getattr(value, '__name__', 'it')}({params}) cannot take them: {e}"
        )

    return check


def optional_callable(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not callable(value):
        raise InvalidArgumentError(
            f"{type(inst).__name__}.{attribute.name} must be callable or None; got {value!r}"
        )


def is_callable(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not callable(value):
        raise InvalidArgumentError(
            f"{type(inst).__name__}.{attribute.name} must be callable; got {value!r}"
        )
