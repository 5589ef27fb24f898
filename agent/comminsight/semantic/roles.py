"""Communicator roles and operation signatures: the alphabet the semantic engine reads.

A role says what a communicator is for in the parallel layout (data, tensor or pipeline
parallel, the whole world, ...). Roles come, in this order, from the group description
(Megatron's ``TENSOR_MODEL_PARALLEL_GROUP``, PyTorch's ``default_pg``), from which parallel
coordinate varies among the members (when the table carries dp/pp/tp coordinates and member
lists), from the group shape (all ranks -> world; point-to-point only -> pp; one member ->
local; consecutive ranks -> tp; strided -> dp).

A signature is one integer per event: ``(role * 16 + op) * 64 + size_bucket`` where
size_bucket is ``bytes.bit_length()`` (0 when the size is unknown). Role and op codes are
fixed tables, so signatures mean the same thing across runs, chunks and checkpoints.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa

from comminsight.evidence.schema import OPS

ROLES = ("other", "world", "dp", "tp", "pp", "ep", "cp", "local")
ROLE_CODE = {name: i for i, name in enumerate(ROLES)}
OP_CODE = {name: i for i, name in enumerate(OPS)}
N_SIGNATURES = len(ROLES) * 16 * 64

# Keywords in a group description, checked in order (lower case, substring).
_DESC_KEYWORDS = (
    ("tensor", "tp"),
    ("pipeline", "pp"),
    ("embedding", "pp"),
    ("expert", "ep"),
    ("context", "cp"),
    ("data_parallel", "dp"),
    ("data_modulo", "dp"),
    ("default_pg", "world"),
    ("world", "world"),
    ("global", "world"),
)
_COORD_ROLE = {"dp_rank": "dp", "pp_rank": "pp", "tp_rank": "tp", "cp_rank": "cp"}


def role_from_desc(desc: str | None) -> str | None:
    """Role named by a group description, or None."""
    if not desc:
        return None
    low = desc.lower()
    for key, role in _DESC_KEYWORDS:
        if key in low:
            return role
    return None


def role_rows(table: pa.Table | pl.DataFrame) -> pl.DataFrame:
    """What roles are inferred from: the first row of every (communicator, rank, op), in table order.

    The role rows of disjoint sets of ranks, concatenated in rank order, are those of the whole table.
    """
    df = table if isinstance(table, pl.DataFrame) else pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)
    keep = [
        c
        for c in ("comm_id", "rank", "op", "is_p2p", "comm_desc", "comm_size", "comm_ranks", *_COORD_ROLE)
        if c in df.columns
    ]
    return df.select(keep).unique(subset=["comm_id", "rank", "op"], keep="first", maintain_order=True)


def infer_roles(table: pa.Table | pl.DataFrame) -> dict[str, str]:
    """comm_id -> role for every communicator in an operations table, or in its ``role_rows`` (see module doc)."""
    df = table if isinstance(table, pl.DataFrame) else pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)
    if df.height == 0:
        return {}
    world = df.get_column("rank").n_unique()
    # Roles depend on communicators, not events: work on one row per (communicator, rank, op).
    df = role_rows(df)
    coords = [c for c in _COORD_ROLE if c in df.columns and df.get_column(c).null_count() < df.height]
    rank_coords = (
        df.filter(pl.all_horizontal(pl.col(c).is_not_null() for c in coords))
        .group_by("rank")
        .agg([pl.col(c).first() for c in coords])
        if coords
        else None
    )
    per_comm = df.group_by("comm_id").agg(
        desc=pl.col("comm_desc").drop_nulls().first(),
        size=pl.col("comm_size").drop_nulls().max(),
        members=pl.col("comm_ranks").drop_nulls().first(),
        seen=pl.col("rank").unique().sort(),
        p2p_only=pl.col("is_p2p").all(),
        compute=(pl.col("op") == "compute").all(),
    )
    coord_of: dict[int, tuple] = {}
    if rank_coords is not None:
        for row in rank_coords.iter_rows():
            coord_of[row[0]] = row[1:]
    roles: dict[str, str] = {}
    for comm_id, desc, size, members, seen, p2p_only, compute in per_comm.iter_rows():
        role = role_from_desc(desc)
        members = list(members) if members is not None else list(seen)
        size = size if size is not None else len(members)
        if role is None and compute:
            role = "local"
        if role is None and size <= 1:
            role = "local"
        if role is None and coords and all(m in coord_of for m in members):
            varying = [coords[i] for i in range(len(coords)) if len({coord_of[m][i] for m in members}) > 1]
            if len(varying) == 1:
                role = _COORD_ROLE[varying[0]]
            elif len(members) == world:
                role = "world"
        if role is None and p2p_only:
            role = "pp"
        if role is None and size >= world:
            role = "world"
        if role is None and len(members) > 1:
            gaps = np.diff(np.sort(np.asarray(members)))
            role = "tp" if gaps.size and np.all(gaps == 1) else "dp"
        roles[comm_id] = role or "other"
    return roles


def signatures(role_codes: np.ndarray, op_codes: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Signature integers from per-event role codes, op codes and byte counts (-1 = unknown)."""
    b = np.maximum(nbytes, 0).astype(np.float64)
    # bit_length of each size, vectorised: frexp's exponent e has b = m * 2**e with 0.5 <= m < 1, i.e.
    # e = floor(log2(b)) + 1 for b > 0 and 0 for b = 0 (exact for sizes below 2**53).
    bucket = np.minimum(np.frexp(b)[1].astype(np.int64), 63)
    return (role_codes.astype(np.int64) * 16 + op_codes.astype(np.int64)) * 64 + bucket


def decode_signature(sig: int) -> tuple[str, str, int]:
    """(role, op, size_bucket) of a signature integer."""
    bucket = sig % 64
    op = (sig // 64) % 16
    role = sig // (64 * 16)
    return ROLES[role], OPS[op] if op < len(OPS) else "other", bucket
