"""The Arrow compute functions the importers and the schema use, called by name.

``pyarrow.compute`` builds, when it is imported, a Python wrapper with a parsed docstring for every
one of its ~280 functions: about 0.035 s of CPU, a tenth of a fresh ``comminsight analyze
stragglers`` on small traces. The same functions are reached through pyarrow's function registry
(``call_function``, the call every one of those wrappers ends in, and the option classes, all from
the extension module ``pyarrow.compute`` re-exports them from), which costs nothing at import. Array
methods that go through ``pyarrow.compute`` (``Array.cast``, ``.take``, ``.is_valid``, ``.fill_null``,
``.dictionary_encode``, ``Table.take``) import it on first use, so the modules on the command line's
load path call these instead. ``tests/cli/test_lean_start.py`` checks that such a run never imports it.

Each function takes and returns what its namesake in ``pyarrow.compute`` does, for the arguments used here.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
from pyarrow._compute import CastOptions, MatchSubstringOptions, SetLookupOptions, call_function


def _function(name: str) -> Any:
    def function(*args: Any) -> Any:
        return call_function(name, args)

    function.__name__ = function.__qualname__ = name
    function.__doc__ = f"Arrow's ``{name}`` on the arguments (``pyarrow.compute.{name}``)."
    return function


and_ = _function("and")
coalesce = _function("coalesce")
dictionary_encode = _function("dictionary_encode")
equal = _function("equal")
if_else = _function("if_else")
invert = _function("invert")
is_null = _function("is_null")
is_valid = _function("is_valid")
multiply_checked = _function("multiply_checked")
take = _function("take")  # bounds checked, as pyarrow.compute.take's default
unique = _function("unique")


def fill_null(values: Any, fill_value: Any) -> Any:
    """``values`` with each null replaced by ``fill_value``, converted to the values' type as
    ``pyarrow.compute.fill_null`` does (coalesce alone would widen the result to a wider fill's type)."""
    if not isinstance(fill_value, pa.Array | pa.ChunkedArray | pa.Scalar):
        fill_value = pa.scalar(fill_value, type=values.type)
    elif values.type != fill_value.type:
        fill_value = pa.scalar(fill_value.as_py(), type=values.type)
    return call_function("coalesce", [values, fill_value])


def is_in(values: Any, value_set: pa.Array) -> Any:
    """Whether each of ``values`` is one of ``value_set`` (nulls: false)."""
    return call_function("is_in", [values], SetLookupOptions(value_set))


def starts_with(strings: Any, pattern: str) -> Any:
    """Whether each string starts with ``pattern``."""
    return call_function("starts_with", [strings], MatchSubstringOptions(pattern))


def cast(values: Any, target_type: pa.DataType) -> Any:
    """``values`` as ``target_type``, refusing lossy conversions (as ``Array.cast`` does by default)."""
    return call_function("cast", [values], CastOptions.safe(target_type))
