"""coda.testing: tools to fuzz epilogues, for coda's suite and for users' own primitives.

* ``strategies``: hypothesis strategies (``epilogues``, ``cases``, ``tilings``) drawing
  random valid compositions, ragged shapes, tilings, dtypes and inputs; extensible with
  your own primitive factories (``epilogues(extra=[my_factory])``).
* ``tolerance``: normwise error against a float64 reference, and assertions.
* ``profiles``: the ``ci`` / ``dev`` hypothesis profiles and ``examples(n)``.
* ``properties``: ``check_case``, the simulator == reference (== your truth) property.
* ``fns``: the catalogue of Elementwise functions random compositions use.

The property coda's suite checks, usable on any case::

    from coda.testing import check_case
    check_case(case)   # simulate == reference == float64 within tolerance
"""

from coda.testing import fns, profiles, strategies, tolerance
from coda.testing.profiles import examples, load_profile
from coda.testing.properties import CaseResult, check_case
from coda.testing.strategies import Case, Composer, cases, epilogues, make_inputs, tilings
from coda.testing.tolerance import assert_close_to_reference, compare, rel_err

__all__ = [
    "Case",
    "CaseResult",
    "Composer",
    "assert_close_to_reference",
    "cases",
    "check_case",
    "compare",
    "epilogues",
    "examples",
    "fns",
    "load_profile",
    "make_inputs",
    "profiles",
    "rel_err",
    "strategies",
    "tilings",
    "tolerance",
]
