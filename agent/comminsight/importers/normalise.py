"""Spelling normalisation shared by importers: operation names, data types, shapes.

Sources spell the same thing many ways ("nccl:_all_gather_base", "AllGather", "allgather";
"BFloat16", "ncclBfloat16", "c10::BFloat16"). The maps here run once per *distinct* value
and are then applied to whole Arrow columns, so the cost does not grow with the row count.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache

import numpy as np
import pyarrow as pa

from comminsight.evidence import compute as pc

# Ordered: the first key that the squeezed name starts with wins ("reducescatter" before "reduce").
_OP_PREFIXES = (
    ("sendrecv", "other"),
    ("allreduce", "all_reduce"),
    ("allgather", "all_gather"),
    ("reducescatter", "reduce_scatter"),
    ("alltoall", "all_to_all"),
    ("broadcast", "broadcast"),
    ("bcast", "broadcast"),
    ("barrier", "barrier"),
    ("reduce", "reduce"),
    ("gather", "gather"),
    ("scatter", "scatter"),
    ("send", "send"),
    ("isend", "send"),
    ("recv", "recv"),
    ("irecv", "recv"),
    ("coalesced", "coalesced"),
    ("startcoalescing", "coalesced"),
    ("endcoalescing", "coalesced"),
)

_DTYPES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float": "float32",
    "float32": "float32",
    "fp32": "float32",
    "half": "float16",
    "float16": "float16",
    "fp16": "float16",
    "double": "float64",
    "float64": "float64",
    "long": "int64",
    "int64": "int64",
    "int": "int32",
    "int32": "int32",
    "short": "int16",
    "int16": "int16",
    "char": "int8",
    "int8": "int8",
    "byte": "uint8",
    "uint8": "uint8",
    "uint32": "uint32",
    "uint64": "uint64",
    "bool": "bool",
    "float8e4m3": "float8_e4m3",
    "float8e4m3fn": "float8_e4m3",
    "float8e5m2": "float8_e5m2",
}

ITEMSIZE = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "bool": 1,
    "float8_e4m3": 1,
    "float8_e5m2": 1,
}

_NON_ALNUM = re.compile(r"[^a-z0-9]")


@lru_cache(maxsize=65536)
def op_name(raw: str | None) -> str:
    """The normalised op (one of evidence.OPS) for one source spelling; "other" when unknown."""
    if not raw:
        return "other"
    text = raw.strip().lower()
    # "nccl:all_reduce", "c10d::allreduce_" -> the part after the last ':'; "send 0->3" -> "send".
    text = text.rsplit(":", 1)[-1].strip()
    text = text.split(" ", 1)[0]
    squeezed = _NON_ALNUM.sub("", text)
    if squeezed.startswith("nccl"):
        squeezed = squeezed[4:]
    for prefix, name in _OP_PREFIXES:
        if squeezed.startswith(prefix):
            return name
    return "other"


@lru_cache(maxsize=4096)
def dtype_name(raw: str | None) -> str | None:
    """The normalised dtype (lower case, e.g. "bfloat16") for one source spelling; None when empty."""
    if not raw:
        return None
    text = raw.strip().lower().rsplit(":", 1)[-1]
    squeezed = _NON_ALNUM.sub("", text.removeprefix("nccl").removeprefix("torch."))
    if squeezed.startswith("nccl"):
        squeezed = squeezed[4:]
    return _DTYPES.get(squeezed, text or None)


def map_distinct(values: pa.Array | pa.ChunkedArray, fn, type_: pa.DataType = pa.string()) -> pa.Array:
    """Apply ``fn`` to each distinct value of a string column and spread the results back, vectorised."""
    values = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
    if len(values) == 0:
        return pa.array([], type_)
    encoded = pc.dictionary_encode(values)
    dictionary = encoded.dictionary.to_pylist()
    mapped = pa.array([fn(v) for v in dictionary], type_)
    indices = encoded.indices
    if indices.null_count:
        # Null inputs map as fn(None) does.
        null_value = fn(None)
        if len(mapped) == 0:  # nothing but nulls
            return pa.repeat(pa.scalar(null_value, type_), len(values))
        out = pc.take(mapped, pc.fill_null(indices, 0))
        return pc.if_else(pc.is_null(indices), pa.scalar(null_value, type_), out)
    return pc.take(mapped, indices)


def ops(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Normalised op names for a column of source spellings."""
    return map_distinct(values, op_name)


def dtypes(values: pa.Array | pa.ChunkedArray) -> pa.Array:
    """Normalised dtypes for a column of source spellings."""
    return map_distinct(values, dtype_name)


def itemsizes(dtype_column: pa.Array) -> np.ndarray:
    """Bytes per element for a column of normalised dtypes (0 when unknown), as an int64 array."""
    sizes = map_distinct(dtype_column, lambda d: ITEMSIZE.get(d or "", 0), pa.int64())
    return np.asarray(sizes.to_numpy(zero_copy_only=False), dtype=np.int64)


def shape_text(shapes: Iterable[Iterable[int]]) -> str:
    """Canonical text of a list of tensor shapes, e.g. ``[[4027, 5120]]``."""
    return _shape_text(tuple(tuple(shape) for shape in shapes))


@lru_cache(maxsize=65536)
def _shape_text(shapes: tuple[tuple[int, ...], ...]) -> str:
    return "[" + ", ".join("[" + ", ".join(str(int(d)) for d in shape) + "]" for shape in shapes) + "]"


def shape_display(shape: str | None) -> str:
    """Human form of a canonical shape text: ``[[4027, 5120]]`` -> ``4027x5120`` (tensors joined by ', ')."""
    if not shape:
        return ""
    inner = shape.strip()
    if inner.startswith("[[") and inner.endswith("]]"):
        tensors = inner[2:-2].split("], [")
        return ", ".join("x".join(d.strip() for d in t.split(",") if d.strip()) or "scalar" for t in tensors)
    return inner


def trailing_int(name: str) -> int | None:
    """The integer a file name ends with (``_dump_12`` -> 12, ``rank3.json`` -> 3), or None."""
    match = re.search(r"(\d+)(?:\.[A-Za-z0-9]+)*$", name)
    return int(match.group(1)) if match else None
