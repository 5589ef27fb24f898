"""Communicator roles and operation signatures: the alphabet the semantic engine reads.

A role says what a communicator is for in the parallel layout (data, tensor or pipeline
parallel, the whole world, ...). Roles come, in this order, from the group description
(Megatron's ``TENSOR_MODEL_PARALLEL_GROUP``, PyTorch's ``default_pg``), from which parallel
coordinate varies among the members (when the table carries dp/pp/tp coordinates and member
lists), from the group shape (all ranks -> world; point-to-point only -> pp; one member ->
local; consecutive ranks -> tp; strided -> dp).

Roles read from the shape alone are then checked against how communicators nest (the structure
a parallel layout leaves in the member sets, whatever coordinate columns the input has): ranks
joined by send/receive form pipelines; a collective group within one pipeline is a pipeline-side
group (embedding: pp); a group of one pipeline stage that strictly contains another such group is
a data-parallel group spanning a further axis (Megatron's data-parallel group with context
parallelism: dp), and a group inside it is the context-parallel one (cp), strided under tensor
parallelism and consecutive without it (read as TP by shape, it split each DP replica in two). Without this,
a job with context parallelism and no cp coordinate read its context-parallel all-gathers as
data-parallel ones, and its data-parallel groups as tensor-parallel when they were consecutive.

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


def roles_from_shape_alone(table: pa.Table | pl.DataFrame) -> bool:
    """True when ``table`` names no communicator's role: no group description and no parallel coordinate.

    Then every collective group's role is read from its member set (``infer_roles``), which a layout
    of another shape can mislead (an HSDP shard group is consecutive ranks, like a TP group).
    """
    df = table if isinstance(table, pl.DataFrame) else pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)
    labels = [c for c in ("comm_desc", *_COORD_ROLE) if c in df.columns]
    return all(df.get_column(c).null_count() == df.height for c in labels)


def role_rows(table: pa.Table | pl.DataFrame) -> pl.DataFrame:
    """What roles are inferred from: the first row of every (communicator, rank, op, peer), in table order.

    The role rows of disjoint sets of ranks, concatenated in rank order, are those of the whole table.
    """
    df = table if isinstance(table, pl.DataFrame) else pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)
    keep = [
        c
        for c in ("comm_id", "rank", "op", "is_p2p", "peer", "comm_desc", "comm_size", "comm_ranks", *_COORD_ROLE)
        if c in df.columns
    ]
    # Point-to-point rows: one per peer as well (the send/receive pairs give the pipelines).
    key = ["comm_id", "rank", "op", *(["peer"] if "peer" in keep else [])]
    return df.select(keep).unique(subset=key, keep="first", maintain_order=True)


def coordinate_rows(table: pa.Table | pl.DataFrame) -> pl.DataFrame:
    """What ``infer_roles`` and ``infer_coordinates`` read of a table, in table order: its ``role_rows`` and, of the
    point-to-point rows to another rank, each rank's first in time and the first of each (rank, peer), with their
    times. Those of disjoint sets of whole ranks, concatenated in table order, give the whole table's roles and
    coordinates (a few rows per communicator and rank, not the table)."""
    df = table if isinstance(table, pl.DataFrame) else pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)
    times = [c for c in ("start_ns", "enqueue_ns") if c in df.columns]
    keep = [*role_rows(df.head(0)).columns, *times]
    key = ["comm_id", "rank", "op", *(["peer"] if "peer" in keep else [])]
    df = df.select(keep).with_row_index("_r")
    first = pl.struct(key).is_first_distinct()
    if {"is_p2p", "peer", "op"} <= set(df.columns):
        p2p = df.filter(pl.col("is_p2p") & pl.col("peer").is_not_null() & (pl.col("peer") != pl.col("rank")))
        order = pl.col("_r").sort_by(times, nulls_last=True) if times else pl.col("_r")  # as ``_stages`` orders
        earliest = p2p.group_by("rank").agg(order.first()).get_column("_r")
        per_peer = p2p.filter(pl.struct("rank", "peer").is_first_distinct()).get_column("_r")
        first = first | pl.col("_r").is_in(pl.concat([earliest, per_peer]).implode())
    return df.filter(first).drop("_r")


def infer_roles(table: pa.Table | pl.DataFrame) -> dict[str, str]:
    """comm_id -> role for every communicator in an operations table, or in its ``role_rows`` (see module doc)."""
    df = table if isinstance(table, pl.DataFrame) else pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)
    if df.height == 0:
        return {}
    world = df.get_column("rank").n_unique()
    # Roles depend on communicators, not events: work on one row per (communicator, rank, op).
    df = role_rows(df)
    links = (
        df.filter(pl.col("is_p2p") & pl.col("peer").is_not_null()).select("rank", "peer").unique()
        if "peer" in df.columns and "is_p2p" in df.columns
        else None
    )
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
    groups: dict[str, frozenset[int]] = {}  # collective groups of several members (not the world)
    by_shape: set[str] = set()  # those whose role came from their shape alone
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
            by_shape.add(comm_id)
        if role not in ("pp", "world", "local") and 1 < len(members) < world and not compute:
            groups[comm_id] = frozenset(int(m) for m in members)
        roles[comm_id] = role or "other"
    if by_shape:
        roles.update(_roles_from_nesting(groups, by_shape, roles, links))
    return roles


def _pipelines(links: pl.DataFrame | None) -> dict[int, int]:
    """rank -> pipeline id: the connected components of the send/receive pairs (union-find)."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    if links is not None:
        for a, b in links.iter_rows():
            ra, rb = find(int(a)), find(int(b))
            if ra != rb:
                parent[max(ra, rb)] = min(ra, rb)
    return {r: find(r) for r in parent}


def _roles_from_nesting(
    groups: dict[str, frozenset[int]], by_shape: set[str], roles: dict[str, str], links: pl.DataFrame | None
) -> dict[str, str]:
    """Corrected roles of the shape-read groups (see module doc); per group, not per event."""
    pipe = _pipelines(links)
    out: dict[str, str] = {}
    one_stage: dict[str, frozenset[int]] = {}
    for comm_id, members in groups.items():
        lines = [pipe.get(m, -1 - m) for m in members]  # a rank without send/receive is its own pipeline
        if len(set(lines)) == 1:
            if comm_id in by_shape:
                out[comm_id] = "pp"  # every member in one pipeline: an embedding-style group across stages
        elif len(set(lines)) == len(lines):
            one_stage[comm_id] = members  # at most one member per pipeline: one stage of the pipelines
    # Groups of one stage, by size; which strictly contain another (a few hundred groups: sets, not events).
    groups = sorted(one_stage.items(), key=lambda kv: len(kv[1]))
    by_rank: dict[int, list[tuple[str, frozenset[int]]]] = {}
    for comm_id, members in groups:
        for m in members:
            by_rank.setdefault(m, []).append((comm_id, members))
    inner_of: dict[str, list[str]] = {}
    for comm_id, members in groups:
        anyone = next(iter(members))
        for other, om in by_rank[anyone]:
            if len(om) > len(members) and members < om:
                inner_of.setdefault(other, []).append(comm_id)
    members_of = dict(groups)
    for outer, inner in inner_of.items():
        if outer in by_shape:
            out[outer] = "dp"
        if out.get(outer, roles[outer]) != "dp":
            continue
        shaped = [c for c in inner if c in by_shape and out.get(c, roles[c]) in ("dp", "tp")]
        # Megatron with context parallelism also builds a plain data-parallel group (one CP index, every
        # replica) inside the data-parallel-with-CP group. In the outer group's rank order (CP before DP)
        # a CP group holds consecutive members and a plain DP group every cp-th: when both kinds are
        # there, the consecutive ones are CP and the strided ones the plain DP groups.
        position = {m: i for i, m in enumerate(sorted(members_of[outer]))}
        consecutive = {c for c in shaped if np.all(np.diff(sorted(position[m] for m in members_of[c])) == 1)}
        both = bool(consecutive) and len(consecutive) < len(shaped)
        for comm_id in shaped:
            # Inside a data-parallel group: its context-parallel part, strided (under TP) or consecutive
            # (without TP). A tensor-parallel group never lies inside one (its members differ in TP rank).
            out[comm_id] = "dp" if both and comm_id not in consecutive else "cp"
    return out


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


def infer_coordinates(table: pa.Table | pl.DataFrame) -> pl.DataFrame | None:
    """Per-rank parallel coordinates read from structure, for a table without coordinate columns.

    Columns ``rank`` and those of ``pp_rank``, ``dp_rank``, ``tp_rank``, ``cp_rank`` that the
    structure decides; None when it decides none, and for a job without a pipeline (no send/receive
    chain), whose groups' shapes alone cannot tell TP from DP.
    - ``pp_rank``: the position along the rank's send/receive chain (a pipeline), counted from the
      end whose first point-to-point operation is a send (the first stage sends activations first;
      the last receives first); every pipeline must be a simple chain (or ring) of one length.
    - ``tp_rank``, ``cp_rank``: the rank's index in its group of that role (``infer_roles``), when
      the groups of that role within one stage (at most one member per pipeline) partition the ranks.
    - ``dp_rank``: the index, in the rank's data-parallel group, of its context-parallel group (of
      itself without one), ordered by lowest rank: the replica the rank belongs to.
    """
    df = table if isinstance(table, pl.DataFrame) else pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)
    if df.height == 0:
        return None
    rows = role_rows(df)
    roles = infer_roles(rows)
    ranks = sorted(int(r) for r in rows.get_column("rank").unique().to_list())
    cols: dict[str, dict[int, int]] = {}
    stage = _stages(df, ranks)
    links = (
        rows.filter(pl.col("is_p2p") & pl.col("peer").is_not_null()).select("rank", "peer")
        if {"is_p2p", "peer"} <= set(rows.columns)
        else None
    )
    if stage is None:
        # Without a pipeline the groups' shapes do not decide their roles: consecutive ranks are a TP group
        # or a DP group alike (a DDP job's sub-groups of halves read as TP), and an index across such guesses
        # would make groups of ranks that share nothing ("tp=1" = ranks 1 and 5 of a DDP job).
        return None
    pipe = _pipelines(links)
    cols["pp_rank"] = stage
    members = rows.group_by("comm_id").agg(
        members=pl.col("comm_ranks").drop_nulls().first() if "comm_ranks" in rows.columns else pl.lit(None),
        seen=pl.col("rank").unique().sort(),
    )
    group_of: dict[str, dict[int, frozenset[int]]] = {}
    for comm_id, listed, seen in members.iter_rows():
        role = roles.get(comm_id)
        if role not in ("dp", "tp", "cp"):
            continue
        group = frozenset(int(m) for m in (listed if listed is not None else seen))
        if len(group) < 2 or len({pipe.get(m, -1 - m) for m in group}) < len(group):
            continue  # a group across pipeline stages (model-parallel: TP x PP) is not one of a stage
        of = group_of.setdefault(role, {})
        for m in group:
            held = of.setdefault(m, group)
            if role == "dp" and held and (held < group or group < held):
                of[m] = max(
                    held, group, key=len
                )  # a plain DP group inside the DP-with-CP group: the replica is the outer's
            elif held != group:
                of[m] = frozenset()  # in two different groups of one role: undecided
    decided = {role: of for role, of in group_of.items() if set(of) == set(ranks) and all(of.values())}
    for role in ("tp", "cp"):
        if role in decided:
            cols[f"{role}_rank"] = {r: sorted(g).index(r) for r, g in decided[role].items()}
    if "dp" in decided:
        inner = decided.get("cp", {})
        cols["dp_rank"] = {}
        for r, g in decided["dp"].items():
            units = sorted({min(inner.get(m, frozenset((m,)))) for m in g})
            cols["dp_rank"][r] = units.index(min(inner.get(r, frozenset((r,)))))
    if not cols:
        return None
    return pl.DataFrame(
        {"rank": ranks, **{c: [cols[c].get(r) for r in ranks] for c in sorted(cols)}},
        schema={"rank": pl.Int64, **{c: pl.Int64 for c in sorted(cols)}},
    )


def _stages(df: pl.DataFrame, ranks: list[int]) -> dict[int, int] | None:
    """rank -> pipeline stage from the send/receive chains (see ``infer_coordinates``), or None."""
    if not {"is_p2p", "peer", "op"} <= set(df.columns):
        return None
    p2p = df.filter(pl.col("is_p2p") & pl.col("peer").is_not_null() & (pl.col("peer") != pl.col("rank")))
    if p2p.is_empty():
        return None
    order = [c for c in ("start_ns", "enqueue_ns") if c in p2p.columns]
    first = p2p.group_by("rank").agg(
        op=(pl.col("op").sort_by(order, nulls_last=True) if order else pl.col("op")).first(),
        peer=(pl.col("peer").sort_by(order, nulls_last=True) if order else pl.col("peer")).first(),
    )
    first_op = {int(r): (op, int(p)) for r, op, p in first.iter_rows()}
    near: dict[int, set[int]] = {}
    for a, b in p2p.select("rank", "peer").unique().iter_rows():
        near.setdefault(int(a), set()).add(int(b))
        near.setdefault(int(b), set()).add(int(a))
    if any(len(n) > 2 for n in near.values()):
        return None  # not a chain: point-to-point traffic of another kind
    pipe = _pipelines(p2p.select("rank", "peer"))
    lines: dict[int, list[int]] = {}
    for r, p in pipe.items():
        lines.setdefault(p, []).append(r)
    stage: dict[int, int] = {}
    for line in lines.values():
        ends = [r for r in line if len(near[r]) == 1] or line  # a ring has no ends
        senders = [r for r in ends if first_op.get(r, ("", -1))[0] == "send"]
        start = senders[0] if len(senders) == 1 else min(ends)
        prev, cur, chain = -1, start, [start]
        while True:
            nxt = sorted(near[cur] - {prev} - set(chain))
            if not nxt:
                break
            sent_to = first_op.get(cur, ("", -1))[1]
            prev, cur = cur, sent_to if sent_to in nxt and len(nxt) > 1 else nxt[0]
            chain.append(cur)
        if len(chain) != len(line):
            return None
        stage.update({r: i for i, r in enumerate(chain)})
    if len({len(line) for line in lines.values()}) != 1:
        return None
    return {r: stage.get(r, 0) for r in ranks} if set(stage) >= set(ranks) else None
