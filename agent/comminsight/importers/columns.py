"""Turning decoded source columns into a conformed operations table, with errors a user can act on.

Importers collect each column once (a list per column filled in a single pass over the source, or
an Arrow/numpy array) and call ``to_table`` at the end. Arrays are typed from the schema, so a
source value of the wrong type fails here, naming the column, not deep inside an analysis.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from comminsight.evidence import SCHEMA, compute, conform
from comminsight.importers import EvidenceError

# Operations one import may produce: about 256 bytes a row in Arrow, held twice while the parts are
# concatenated, so an import stays under 1 GB of memory.
MAX_ROWS = 1_500_000


def _array(values: Sequence[Any] | np.ndarray, type_: pa.DataType) -> pa.Array:
    # NaN in a float array means "missing", as from_pandas=True would say, without importing pandas.
    if isinstance(values, np.ndarray) and values.dtype.kind == "f":
        return pa.array(values, type=type_, mask=np.isnan(values))
    return pa.array(values, type=type_)


def to_table(columns: Mapping[str, Sequence[Any] | pa.Array | np.ndarray], path: Path | str) -> pa.Table:
    """A conformed operations table from ``columns`` (schema names; missing ones become nulls).

    Raises EvidenceError naming ``path`` and the column when a value cannot take the schema's type.
    """
    arrays = {}
    lengths = set()
    for name, values in columns.items():
        field = SCHEMA.field(name)
        try:
            if isinstance(values, pa.Array | pa.ChunkedArray):
                array = values if values.type == field.type else compute.cast(values, field.type)
            else:
                array = _array(values, field.type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError, TypeError) as exc:
            raise EvidenceError(f"{path}: column {name!r} has a value of the wrong type: {exc}") from exc
        arrays[name] = array
        lengths.add(len(array))
    if len(lengths) > 1:
        raise EvidenceError(f"{path}: internal error, columns of different lengths {sorted(lengths)}")
    try:
        return conform(pa.table(arrays) if arrays else SCHEMA.empty_table())
    except ValueError as exc:
        raise EvidenceError(f"{path}: {exc}") from exc


def concat(tables: Sequence[pa.Table]) -> pa.Table:
    """Concatenate conformed tables (same schema) into one."""
    if not tables:
        return SCHEMA.empty_table()
    return pa.concat_tables(tables).combine_chunks()


@contextmanager
def paused_gc() -> Iterator[None]:
    """Cyclic garbage collection paused while a source is decoded into Python containers and mapped.

    Decoding a dump or trace makes millions of small dicts and lists that hold no cycles; each
    allocation burst would otherwise trigger collections that walk everything already decoded,
    costing more than the decoding itself. Reference counting still frees them when the load returns.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
