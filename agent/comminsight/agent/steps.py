"""Live steps: the semantic engine fed by every record the agent consumes, per GPU (writer process).

Every completed Coll/P2P record goes, as one engine event, to the chunked ``StepEngine``
(comminsight.semantic). Once a step is final (``window`` later steps opened on that GPU), its
summary is appended as one JSON line to ``<home>/semantics/step/<host>-<pid>.jsonl``
(format: docs/formats/steps.md). The engine state, each file's committed size and, per writer,
the highest ``record_seq`` fed are checkpointed to ``<home>/semantics/step/checkpoint.json`` just
before the agent's ingest checkpoint: a restarted agent truncates each file to its checkpointed
size, resumes the engine, and skips records it already fed, so no step is lost or written twice.

Engine keys are writer pids (one process drives one GPU); the global rank (segment header
``RANK``) is attached when a summary is written. The steps are those offline recovery gives over the node's
archive (docs/agent.md, "The same steps as the node's archive"): each writer's records, which come in
completion order, are held until no later record can start before them and fed in the offline order
(``_release``, ``_program_order``); roles are read once from the whole node's communicators through the one
record decoder (``_settle_roles``) and fixed, so signatures stay the same across chunks and restarts.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from comminsight.agent.ingest import atomic_write_json
from comminsight.formats import header
from comminsight.formats.operations import SegmentRecords, operations
from comminsight.formats.rawlog import SegmentHeader
from comminsight.formats.ring import Columns, columns
from comminsight.importers.normalise import op_name
from comminsight.semantic import CheckpointError, StepEngine
from comminsight.semantic.roles import OP_CODE, ROLE_CODE, ROLES, infer_roles, roles_from_shape_alone, signatures

log = logging.getLogger("comminsight.agent.steps")
# 2: records held back for their order (``held``, ``watermark``); a version-1 checkpoint held none and loads as is.
CHECKPOINT_VERSION = 2
READABLE_VERSIONS = (1, 2)
LIVE_WARMUP = 512  # events per GPU before the engine picks a method (the offline default is 4096)
RECENT_PER_RANK = 64
ROLES_WAIT = 8  # polls (batches per GPU) the roles wait for a silent GPU once one GPU has passed the warm-up
MAX_HELD = 1 << 16  # records of one writer held back for their order (``LiveSteps._release``)
RECENT_KEPT = 4  # summaries of one block kept for /api/v1/steps (a block can hold many steps)
_PID_SHIFT = 40  # engine row = pid << 40 | bytes: the engine echoes rows back with their step ids
_BYTES_MASK = (1 << _PID_SHIFT) - 1


def _string_key(column: np.ndarray) -> np.ndarray:
    """A uint64 per fixed-width name (its first 16 bytes mixed), so names are told apart without Python."""
    column = np.ascontiguousarray(column)  # a no-op for the reader's columns
    if column.dtype.itemsize % 8 == 0 and column.dtype.itemsize >= 16:
        words = column.view("<u8").reshape(len(column), -1)  # no copy: the names' first two words
    else:
        raw = column.view(np.uint8).reshape(len(column), -1)[:, :16]
        words = np.ascontiguousarray(raw).view("<u8")
    return words[:, 0] * np.uint64(1000003) ^ words[:, 1]


def _few_distinct(values: np.ndarray, limit: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """(index of each distinct value's first row, each row's code) for a column with few distinct values.

    A batch of one GPU holds a handful of communicators and op names: peeling them off one at a time is
    O(k n) with k small, where ``np.unique`` sorts the whole column (the agent's largest cost here before).
    Beyond ``limit`` distinct values it falls back to ``np.unique``.
    """
    codes = np.zeros(len(values), np.int64)
    firsts = [0]
    rest = np.flatnonzero(values != values[0])
    while len(rest):
        if len(firsts) >= limit:
            _, first, inverse = np.unique(values, return_index=True, return_inverse=True)
            return first, inverse.reshape(-1)
        firsts.append(int(rest[0]))
        same = values[rest] == values[rest[0]]
        codes[rest[same]] = len(firsts) - 1
        rest = rest[~same]
    return np.asarray(firsts, np.int64), codes


def _text(values: np.ndarray) -> list[str]:
    return [bytes(v).split(b"\0", 1)[0].decode("utf-8", "replace") for v in values]


def _as_columns(records: Any) -> Columns:
    """A batch as the ring reader gives it (one array per field), whether it came from a ring or a segment."""
    return records if isinstance(records, Columns) else Columns(columns(records), len(records))


def _concat(parts: list[Columns]) -> Columns:
    parts = [p for p in parts if len(p)]
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return _as_columns(np.zeros(0, header.record_dtype()))
    names = [n for n in parts[0].names if all(n in p.data for p in parts)]
    return Columns({n: np.concatenate([p.data[n] for p in parts]) for n in names}, sum(len(p) for p in parts))


def _records(batch: Columns) -> np.ndarray:
    """``batch`` as sealed-record rows (``header.record_dtype()``): what the decoder and the checkpoint take."""
    out = np.zeros(len(batch), header.record_dtype())
    for name, column in batch.data.items():
        if name in out.dtype.names:
            out[name] = column
    return out


def _times(recs: Any) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) of each record in ns: the GPU's times when it has them, else the host's."""
    if isinstance(recs, Columns) and "_start_ns" in recs.data:  # computed once when the batch came
        return recs.data["_start_ns"], recs.data["_end_ns"]
    gpu = (recs["flags"] & header.constants()["CI_FLAG_GPU_TIMES"]) != 0
    # np.where makes a new uint64 array: read as int64 in place (the same bits astype gives, no second copy).
    start = np.where(gpu, recs["gpu_start_ns"], recs["enqueue_end_ns"]).view(np.int64)
    end = np.where(gpu, recs["gpu_end_ns"], recs["complete_ns"]).view(np.int64)
    return start, end


# The fields of a record the engine's input is made of (``_feed_records``, ``_program_order``, ``_times``).
_FED_FIELDS = (
    "pid",
    "comm_hash",
    "func",
    "kind",
    "peer",
    "seq",
    "bytes",
    "flags",
    "enqueue_start_ns",
    "enqueue_end_ns",
    "gpu_start_ns",
    "gpu_end_ns",
    "complete_ns",
)


def _func_key(recs: Any) -> np.ndarray:
    """``_string_key`` of the records' op names: computed once when a batch comes (``LiveSteps.feed``)."""
    if isinstance(recs, Columns) and "_func_key" in recs.data:
        return recs.data["_func_key"]
    return _string_key(recs["func"])


def _catalogue_key(recs: Any) -> np.ndarray:
    """A uint64 per (communicator, writer, op name, peer) of ``recs``."""
    return (
        _func_key(recs)
        ^ recs["comm_hash"].astype(np.uint64, copy=False)
        ^ (recs["pid"].astype(np.uint64) << np.uint64(20))
        ^ (recs["peer"].astype(np.int64).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    )


_OP_ORDER = {op: i for i, op in enumerate(sorted(OP_CODE))}  # op names in the order a sort by name gives


def _program_order(
    recs: Any,
    pid: np.ndarray,
    start: np.ndarray,
    pair_first: np.ndarray,
    pair_codes: np.ndarray,
    names: list[str],
    one_writer: bool,
) -> np.ndarray | None:
    """The positions of ``recs`` in the order offline recovery reads operations (``ORDER_COLUMNS``), or None.

    By writer, start, issue time, communicator, kind, op name, peer, NCCL sequence number, end and size; as
    the operations table has them (unknown issue times and peers last). Operations a GPU starts at one
    instant (a grouped send and receive) are then read in the same order on both paths.
    """
    if one_writer and np.all(start[1:] > start[:-1]):
        return None  # the usual batch: in start order, no two at one instant
    max_i64 = np.iinfo(np.int64).max
    enqueue = recs["enqueue_start_ns"]
    enqueue = np.where((enqueue == 0) | (enqueue > np.uint64(max_i64)), np.uint64(max_i64), enqueue)
    peer = recs["peer"].astype(np.int64)
    op_rank = np.array([_OP_ORDER.get(op_name(f), len(_OP_ORDER)) for f in names], np.int64)[pair_codes]
    is_p2p = recs["kind"] == header.constants()["CI_KIND_P2P"]
    _, end = _times(recs)
    keys = (
        recs["bytes"],
        end,
        recs["seq"],
        np.where(peer < 0, max_i64, peer),
        op_rank,
        is_p2p,
        recs["comm_hash"],
        enqueue,
        start,
        pid,
    )
    return np.lexsort(keys)


def _summaries(block: dict[str, Any], host: str, lo: int, hi: int) -> list[dict[str, Any]]:
    """Rows ``lo:hi`` of a final block as summary dicts (docs/formats/steps.md): the few kept in memory."""
    by_role = (block["comm_ns"][lo:hi] / 1e9).tolist()
    start, end = block["start_ns"][lo:hi].tolist(), block["end_ns"][lo:hi].tolist()
    return [
        {
            "rank": block["rank"],
            "pid": block["pid"],
            "host": host,
            "step": int(block["step"][i]),
            "start_ns": start[i - lo],
            "end_ns": end[i - lo],
            "duration_s": (end[i - lo] - start[i - lo]) / 1e9,
            "comm_s": sum(by_role[i - lo]),
            "comm_s_by_role": dict(zip(ROLES, by_role[i - lo], strict=True)),
            "wait_s": int(block["wait_ns"][i]) / 1e9,
            "ops": int(block["n_ops"][i]),
            "bytes": int(block["bytes"][i]),
            "method": block["method"],
        }
        for i in range(lo, hi)
    ]


def _summary_lines(blocks: list[dict[str, Any]], host: str) -> bytes:
    """Final blocks of one GPU as JSON lines (docs/formats/steps.md), in one columnar write."""

    def cat(key: str) -> np.ndarray:
        return np.concatenate([b[key] for b in blocks])

    start, end, comm_s = cat("start_ns"), cat("end_ns"), cat("comm_ns") / 1e9
    sizes = [len(b["step"]) for b in blocks]
    frame = pl.DataFrame(
        {
            "rank": np.repeat([b["rank"] for b in blocks], sizes).astype(np.int64),
            "pid": np.repeat([b["pid"] for b in blocks], sizes).astype(np.int64),
            "host": [host] * len(start),
            "step": cat("step"),
            "start_ns": start,
            "end_ns": end,
            "duration_s": (end - start) / 1e9,
            "comm_s": comm_s.sum(axis=1),
            "comm_s_by_role": pl.DataFrame({role: comm_s[:, i] for i, role in enumerate(ROLES)}).to_struct(),
            "wait_s": cat("wait_ns") / 1e9,
            "ops": cat("n_ops"),
            "bytes": cat("bytes"),
            "method": [b["method"] for b, n in zip(blocks, sizes, strict=True) for _ in range(n)],
        }
    )
    sink = io.BytesIO()
    frame.write_ndjson(sink)
    return sink.getvalue()


class LiveSteps:
    """Owned by the agent's loop (feed, checkpoint, archive); HTTP handlers read ``latest``/``recent``."""

    def __init__(self, steps_dir: Path, host: str, pid_rank: Callable[[], dict[int, int]]) -> None:
        self.dir = steps_dir
        self.host = host
        self._pid_rank = pid_rank  # LiveState's pid -> global rank (from segment headers)
        self.checkpoint_path = steps_dir / "checkpoint.json"
        self.lock = threading.Lock()
        # Until a communicator comes with its name, roles are read from shape alone, and a template must
        # agree with each GPU's own period (the offline rule, ``StepEngine`` ``check_templates``).
        self.engine = StepEngine(warmup=LIVE_WARMUP, check_templates=True)
        self.roles: dict[int, int] = {}  # comm_hash -> role code, fixed at first sight
        self.fed_seq: dict[str, int] = {}  # writer -> highest record_seq taken (fed, or held in ``held``)
        self.held: dict[str, Columns] = {}  # writer -> records waiting for their place in start order
        # writer -> (latest end, longest duration, start below which records were released) (``_release``)
        self.watermark: dict[str, tuple[int, int, int]] = {}
        self.late_records = 0  # records that came behind the watermark (fed out of start order)
        # The first record of each (communicator, writer, op, peer): what roles are read from.
        self.catalogue = _as_columns(np.zeros(0, header.record_dtype()))
        self._catalogue_keys: set[int] = set()  # their keys (``_catalogue_key``)
        self._waited = 0  # batches since a GPU passed the warm-up, roles not settled (``_roles_ready``)
        self.settled = False  # roles given to the communicators of the catalogue (``_settle_roles``)
        self.sizes: dict[str, int] = {}  # summary file -> bytes committed by this agent
        self.archived: dict[str, int] = {}  # summary file -> bytes already put into an archive
        # Per GPU (pid): ids of steps not final yet, ascending, and the bytes of their operations so far.
        self.open_bytes: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.pending: list[dict[str, Any]] = []  # final steps not written yet (columns per block)
        self.latest: dict[int, dict[str, Any]] = {}  # global rank -> latest final step
        self.recent: dict[int, deque[dict[str, Any]]] = {}
        self.fresh: dict[int, dict[str, Any]] = {}  # key -> newest final block not yet made into summaries
        self.steps_total: dict[int, int] = {}
        self.new_since_report = False
        self._fingerprint = ""

    @property
    def pid_rank(self) -> dict[int, int]:
        return self._pid_rank()

    # ---- feeding ---------------------------------------------------------------------------------
    def feed(self, writer: str, records: Any) -> int:
        """Take a batch of verified records of one writer; returns the step summaries written.

        Records come in the order their operations completed; the engine reads each GPU's operations in the
        order offline recovery reads them (``comminsight.semantic.order``: by start, then issue time, then what
        they are). A record is held back until no operation of its writer still to come can start before it
        (``_release``), then fed in that order.
        """
        consts = header.constants()
        if len(records) == 0:
            return 0
        seq = records["record_seq"].astype(np.int64)
        keep = (seq > self.fed_seq.get(writer, -1)) & (records["state"] == consts["CI_STATE_COMPLETED"])
        self.fed_seq[writer] = max(self.fed_seq.get(writer, -1), int(seq.max()))
        if not keep.any():
            return 0
        recs = _as_columns(records)
        recs = recs[keep] if not keep.all() else recs
        # What the engine reads of a record, and nothing else, is held, ordered and fed (fewer copies).
        fed = Columns({n: recs.data[n] for n in _FED_FIELDS}, len(recs))
        fed.data["_start_ns"], fed.data["_end_ns"] = _times(recs)
        fed.data["_func_key"] = _string_key(recs["func"])
        self._catalogue(recs, fed.data["_func_key"])
        return self._feed_records(*self._release(writer, fed))

    def _release(self, writer: str, recs: Columns) -> list[Columns]:
        """The held records (``recs`` now among them) that no later record can start before, in parts that follow
        one another in program order (fed as one); holds the rest.

        The plugin writes a record when its operation completes, so every operation still to come ends at or
        after the latest end seen, and starts at most the longest duration seen before that: a record that
        starts earlier than ``latest end - longest duration`` (the writer's watermark) has all its predecessors
        in start order. An operation longer than any before it can still arrive behind the watermark; it is fed
        late, as it comes (``late_records`` counts them). Until the roles are settled (the first GPU has
        ``LIVE_WARMUP`` records and every GPU has shown its own, ``_roles_ready``), every record is held.
        """
        start, end = _times(recs)
        latest, longest, released_to = self.watermark.get(writer, (int(end.max()), 0, np.iinfo(np.int64).min))
        self.late_records += int(np.count_nonzero(start < released_to))
        self.watermark[writer] = (max(latest, int(end.max())), max(longest, int((end - start).max())), released_to)
        held = self.held.get(writer)
        if self.settled and held is not None and len(held):
            # The usual case: a few held records and a batch. Each splits at the watermark on its own; when the
            # held ones released all start before the batch's, both go to the engine in one feed, the held first
            # (the engine's cost per feed is the larger part of a batch's) and no record column is copied.
            held_out, held_in = self._split(writer, held)
            recs_out, recs_in = self._split(writer, recs)
            if len(held_in) + len(recs_in) <= MAX_HELD and (
                not len(held_out) or not len(recs_out) or _times(held_out)[0].max() < _times(recs_out)[0].min()
            ):
                self.held[writer] = _concat([held_in, recs_in])
                return [held_out, recs_out]
        self.held[writer] = _concat([held, recs]) if held is not None else recs
        if not self.settled:
            if not self._roles_ready():
                return []
            self._settle_roles()
            return [_concat([self._release_held(w) for w in sorted(self.held)])]
        return [self._release_held(writer)]

    def _split(self, writer: str, recs: Columns) -> tuple[Columns, Columns]:
        """``recs`` below the writer's watermark, and the rest (both in arrival order); the watermark advances."""
        latest, longest, released_to = self.watermark[writer]
        start, _ = _times(recs)
        release = start < latest - longest
        k = int(np.count_nonzero(release))
        if k:
            self.watermark[writer] = (
                latest,
                longest,
                max(released_to, int(start[release].max()) + 1, latest - longest),
            )
        if release[:k].all():
            return Columns({n: c[:k] for n, c in recs.data.items()}, k), Columns(
                {n: c[k:] for n, c in recs.data.items()}, len(recs) - k
            )
        return recs[release], recs[~release]

    def _roles_ready(self) -> bool:
        """Whether the catalogue shows the node's communicators: a GPU has passed the warm-up and every GPU the
        agent knows of has shown its records, or, since the warm-up was passed, ``ROLES_WAIT`` batches per GPU seen
        have come (the agent reads every ring at each poll: a GPU still silent then is gone or idle)."""
        most = max(len(h) for h in self.held.values())
        if most < LIVE_WARMUP:
            return False
        self._waited += 1
        seen = set(np.unique(self.catalogue["pid"]).tolist())
        if all(pid in seen for pid in self.pid_rank):
            return True
        return most >= MAX_HELD or self._waited > ROLES_WAIT * len(self.held)

    def _release_held(self, writer: str) -> Any:
        """The held records of ``writer`` below its watermark (at most ``MAX_HELD`` stay held)."""
        held = self.held[writer]
        latest, longest, released_to = self.watermark[writer]
        start, _ = _times(held)
        release = start < latest - longest
        if len(held) - np.count_nonzero(release) > MAX_HELD:  # an operation that never seems to end: bound the wait
            release |= start <= np.sort(start)[len(held) - MAX_HELD - 1]
        if release.any():
            released_to = max(released_to, int(start[release].max()) + 1, latest - longest)
        self.watermark[writer] = (latest, longest, released_to)
        k = int(np.count_nonzero(release))
        if release[:k].all():  # the usual case: all but the newest few (views, no copy)
            self.held[writer] = Columns({n: c[k:] for n, c in held.data.items()}, len(held) - k)
            return Columns({n: c[:k] for n, c in held.data.items()}, k)
        self.held[writer] = held[~release]
        return held[release]

    def _feed_records(self, *parts: Any) -> int:
        """Feed released records (any writers) to the engine in one feed, each GPU's in program order; returns
        summaries written. ``parts`` follow one another in program order (``_release``): each is ordered on its
        own and their engine input joined, so no record column is copied to join them."""
        made = [self._chunk(recs) for recs in parts if len(recs)]
        if not made:
            return 0
        if len(made) == 1:
            chunk, only = made[0]
        else:
            chunk = {k: np.concatenate([c[k] for c, _ in made]) for k in made[0][0]}
            onlys = {only for _, only in made}
            only = onlys.pop() if len(onlys) == 1 else None
        out = self.engine.feed(chunk)
        return self._emit(out, only)

    def _chunk(self, recs: Any) -> tuple[dict[str, np.ndarray], int | None]:
        """The engine's input for released records ``recs``, in program order, and their writer if only one."""
        comm = recs["comm_hash"]
        # One code per (communicator, op name) pair: a batch of one GPU holds a handful of them, and role,
        # op and the signature's high part are functions of the pair.
        pair_first, pair_codes = _few_distinct(
            comm.astype(np.uint64, copy=False) * np.uint64(0x9E3779B97F4A7C15) ^ _func_key(recs), limit=32
        )
        comm_values = comm[pair_first].tolist()
        if any(int(c) not in self.roles for c in comm_values):
            self._settle_roles()  # a communicator first seen after the roles were settled
        pair_role = np.array([self.roles[int(c)] for c in comm_values], np.int64)
        names = _text(recs["func"][pair_first])
        pair_op = np.array([OP_CODE.get(op_name(f), OP_CODE["other"]) for f in names], np.int64)
        role = pair_role[pair_codes]
        nbytes = recs["bytes"].astype(np.int64)
        zero = np.zeros(len(pair_first), np.int64)
        # signatures() is linear in its parts: the pair's part plus the size bucket's (role = op = 0).
        sig = signatures(pair_role, pair_op, zero)[pair_codes] + signatures(zero[:1], zero[:1], nbytes)
        start, end = _times(recs)
        pid = recs["pid"].astype(np.int64)
        one_writer = bool(pid[0] == pid[-1] and np.all(pid == pid[0]))  # as rings and segments give
        order = _program_order(recs, pid, start, pair_first, pair_codes, names, one_writer)
        chunk = {
            "rank": pid,
            "row": (pid << _PID_SHIFT) | np.minimum(np.maximum(nbytes, 0), _BYTES_MASK),
            "sig": sig,
            "role": role,
            "start_ns": start,
            "end_ns": np.maximum(end, start),
        }
        if order is not None:
            chunk = {k: v[order] for k, v in chunk.items()}
        return chunk, (int(pid[0]) if one_writer else None)

    def _catalogue(self, recs: Columns, func_key: np.ndarray) -> None:
        """Keep the first record of each (communicator, writer, op, peer) of ``recs``: what roles are read from."""
        keys = _catalogue_key(Columns({**recs.data, "_func_key": func_key}, len(recs)))
        firsts, _ = _few_distinct(keys, limit=64)
        if len(self._catalogue_keys) != len(self.catalogue):  # restored from a checkpoint
            self._catalogue_keys = set(_catalogue_key(self.catalogue).tolist()) if len(self.catalogue) else set()
        first_keys = keys[firsts].tolist()
        new = [i for i, key in zip(firsts.tolist(), first_keys, strict=True) if key not in self._catalogue_keys]
        self._catalogue_keys.update(first_keys)
        if new:
            rows = np.sort(np.asarray(new, np.int64))
            self.catalogue = _concat([self.catalogue, Columns({n: c[rows] for n, c in recs.data.items()}, len(rows))])

    def _settle_roles(self) -> None:
        """Roles of the communicators in the catalogue not given one yet, read as offline recovery reads them.

        The catalogue's records go through the one record decoder (``comminsight.formats.operations``, P2P peers
        as global ranks) and ``infer_roles``, over every GPU of the node seen so far, as over the node's archive;
        a communicator's name is read as its description (the archive path reads descriptions only: see
        docs/agent.md). The first call also decides whether roles come from shape alone (``check_templates``).
        Roles already given stay: signatures must mean the same thing across chunks and restarts.
        """
        if not len(self.catalogue):
            return
        ranks = self.pid_rank
        rows = _records(self.catalogue)
        parts = [
            SegmentRecords(
                SegmentHeader(
                    pid=pid,
                    start_ns=0,
                    segment_index=0,
                    local_rank=-1,
                    global_rank=ranks.get(pid, pid),
                    world_size=0,
                    host="",
                    workload_id="",
                    node_ip="",
                ),
                rows[rows["pid"] == pid],
            )
            for pid in np.unique(rows["pid"]).tolist()
        ]
        table = pl.from_arrow(operations(parts))
        assert isinstance(table, pl.DataFrame)
        table = table.with_columns(comm_desc=pl.coalesce("comm_desc", "comm_name"))
        if not self.settled:
            self.engine.check_templates = roles_from_shape_alone(table)  # kept in the engine's checkpoint
            self.settled = True
        for comm_id, role in infer_roles(table).items():
            self.roles.setdefault(int(comm_id, 16), ROLE_CODE.get(role, 0))
        for c in np.unique(self.catalogue["comm_hash"]).tolist():
            self.roles.setdefault(int(c), 0)

    def flush(self) -> int:
        """End of the job on this node: feed every held record, finalise every open step (and write them)."""
        if not self.settled:
            self._settle_roles()
        held = [recs for recs in self.held.values() if len(recs)]
        self.held = {}
        written = self._feed_records(_concat(held)) if held else 0
        written += self._emit(self.engine.flush())
        self.write_pending()
        return written

    def _emit(self, out: dict[str, Any], only_pid: int | None = None) -> int:
        """Add the bytes of the batch's operations to their steps; queue the steps now final for writing.
        ``only_pid``: the batch was one writer's (the usual case), so rows need no grouping by writer."""
        rows, steps = out["rows"], out["steps"]
        ok = steps >= 0
        if only_pid is not None and len(steps) and steps[0] >= 0:  # steps never decrease: all are >= 0
            self._add_bytes(only_pid, steps, (rows & _BYTES_MASK).astype(np.int64, copy=False))
        elif ok.any():
            pids = (rows[ok] >> _PID_SHIFT).astype(np.int64, copy=False)
            nbytes = (rows[ok] & _BYTES_MASK).astype(np.int64, copy=False)
            step_ids = steps[ok]
            firsts, codes = _few_distinct(pids)
            for code, pid in enumerate(pids[firsts].tolist()):
                if len(firsts) == 1:
                    self._add_bytes(pid, step_ids, nbytes)
                else:
                    mine = codes == code
                    self._add_bytes(pid, step_ids[mine], nbytes[mine])
        written = 0
        ranks = self.pid_rank
        for block in out["final"]:
            pid = int(block["rank"][0])
            rank = ranks.get(pid, -1)
            n = len(block["step"])
            block = {**block, "rank": rank, "pid": pid, "bytes": self._take_bytes(pid, block["step"])}
            self.pending.append(block)
            key = rank if rank >= 0 else -pid
            with self.lock:  # summaries of it are made only when read (views, heartbeat, checkpoint)
                self.fresh[key] = block
                self.steps_total[key] = self.steps_total.get(key, 0) + n
            written += n
        if written:
            self.new_since_report = True
        return written

    def _add_bytes(self, pid: int, steps: np.ndarray, nbytes: np.ndarray) -> None:
        """Fold one batch's (step, bytes) of one GPU into its open steps (steps arrive in ascending order)."""
        if np.all(steps[1:] >= steps[:-1]):
            cuts = np.concatenate(([0], np.flatnonzero(np.diff(steps)) + 1))
            uniq, sums = steps[cuts], np.add.reduceat(nbytes, cuts)
        else:
            uniq, inverse = np.unique(steps, return_inverse=True)
            sums = np.bincount(inverse.reshape(-1), weights=nbytes.astype(np.float64)).astype(np.int64)
        have, acc = self.open_bytes.get(pid, (np.empty(0, np.int64), np.empty(0, np.int64)))
        if len(have) and uniq[0] == have[-1]:  # the step open at the end of the last batch continues
            acc = acc.copy()
            acc[-1] += sums[0]
            uniq, sums = uniq[1:], sums[1:]
        if len(have) and len(uniq) and uniq[0] <= have[-1]:  # out of order: merge the slow way
            both, inverse = np.unique(np.concatenate((have, uniq)), return_inverse=True)
            weights = np.concatenate((acc, sums)).astype(np.float64)
            self.open_bytes[pid] = (both, np.bincount(inverse.reshape(-1), weights=weights).astype(np.int64))
        else:
            self.open_bytes[pid] = (np.concatenate((have, uniq)), np.concatenate((acc, sums)))

    def _take_bytes(self, pid: int, ids: np.ndarray) -> np.ndarray:
        """The bytes of steps ``ids`` of one GPU, which are final: they leave the open steps."""
        have, acc = self.open_bytes.get(pid, (np.empty(0, np.int64), np.empty(0, np.int64)))
        if not len(have):
            return np.zeros(len(ids), np.int64)
        at = np.minimum(np.searchsorted(have, ids), len(have) - 1)
        found = have[at] == ids
        keep = np.ones(len(have), bool)
        keep[at[found]] = False
        self.open_bytes[pid] = (have[keep], acc[keep])
        return np.where(found, acc[at], 0).astype(np.int64)

    def write_pending(self) -> int:
        """Append the final steps queued since the last call to their GPU's file; returns lines written.

        Called before each checkpoint (every second), at flush and before an archive takes the files: one
        columnar write per GPU and second, so a summary costs a row of a frame, not a dict and a JSON dump.
        """
        if not self.pending:
            return 0
        blocks, self.pending = self.pending, []
        by_pid: dict[int, list[dict[str, Any]]] = {}
        for block in blocks:
            by_pid.setdefault(block["pid"], []).append(block)
        written = 0
        for pid, mine in by_pid.items():
            data = _summary_lines(mine, self.host)
            name = f"{self.host}-{pid}.jsonl"
            if name not in self.sizes:  # a new GPU (or a fresh agent): the folder may not exist yet
                self.dir.mkdir(parents=True, exist_ok=True)
            with open(self.dir / name, "ab") as handle:
                handle.write(data)
            self.sizes[name] = self.sizes.get(name, 0) + len(data)
            written += sum(len(b["step"]) for b in mine)
        return written

    def _materialise_locked(self) -> None:
        """Turn the newest final block of each GPU into its latest and recent summaries (caller holds lock)."""
        for key, block in self.fresh.items():
            n = len(block["step"])
            recent = _summaries(block, self.host, max(0, n - RECENT_KEPT), n)
            self.latest[key] = recent[-1]
            self.recent.setdefault(key, deque(maxlen=RECENT_PER_RANK)).extend(recent)
        self.fresh.clear()

    # ---- views -----------------------------------------------------------------------------------
    def latest_steps(self) -> list[dict[str, Any]]:
        """Latest final step per rank, in the live heartbeat's shape (docs/formats/upload.md)."""
        with self.lock:
            self._materialise_locked()
            items = sorted(self.latest.items())
        return [
            {
                "rank": s["rank"],
                "step": s["step"],
                "start_ns": s["start_ns"],
                "end_ns": s["end_ns"],
                "duration_s": s["duration_s"],
                "comm_s": s["comm_s"],
                "ops": s["ops"],
                "bytes": s["bytes"],
            }
            for _, s in items
        ]

    def view(self, limit: int = 16) -> dict[str, Any]:
        with self.lock:
            self._materialise_locked()
            return {
                "ranks": [
                    {
                        "rank": key if key >= 0 else -1,
                        "pid": self.latest[key]["pid"],
                        "steps_total": self.steps_total.get(key, 0),
                        "latest": self.latest[key],
                        "recent": list(self.recent[key])[-limit:],
                    }
                    for key in sorted(self.latest)
                ],
                "methods": {str(k): v.method for k, v in self.engine.ranks.items() if v.method},
                "late_records": self.late_records,
            }

    # ---- checkpoint ------------------------------------------------------------------------------
    def checkpoint(self) -> None:
        """Engine state + file sizes + fed watermarks, atomically (see module doc for the order)."""
        self.write_pending()
        with self.lock:
            self._materialise_locked()
        fingerprint = json.dumps([self.fed_seq, self.sizes, self.archived], sort_keys=True)
        if fingerprint == self._fingerprint:
            return  # nothing fed since the last checkpoint
        for name in self.sizes:
            path = self.dir / name
            if path.exists():
                with open(path, "rb+") as handle:
                    os.fsync(handle.fileno())
        atomic_write_json(
            self.checkpoint_path,
            {
                "version": CHECKPOINT_VERSION,
                "engine": self.engine.checkpoint().decode(),
                "roles": {str(k): v for k, v in self.roles.items()},
                "fed_seq": self.fed_seq,
                "held": {w: base64.b64encode(_records(r).tobytes()).decode() for w, r in self.held.items() if len(r)},
                "watermark": {w: list(m) for w, m in self.watermark.items()},
                "late_records": self.late_records,
                "catalogue": base64.b64encode(_records(self.catalogue).tobytes()).decode(),
                "settled": self.settled,
                "sizes": self.sizes,
                "archived": self.archived,
                "bytes_acc": [
                    [p, s, b]
                    for p, (steps, acc) in self.open_bytes.items()
                    for s, b in zip(steps.tolist(), acc.tolist(), strict=True)
                ],
                "steps_total": {str(k): v for k, v in self.steps_total.items()},
                "latest": {str(k): v for k, v in self.latest.items()},
            },
        )
        self._fingerprint = fingerprint

    def restore(self) -> None:
        """Resume from the checkpoint: truncate summary files to their committed size, reload the engine."""
        try:
            saved = json.loads(self.checkpoint_path.read_text())
            if saved.get("version") not in READABLE_VERSIONS:
                raise ValueError(f"version {saved.get('version')!r}")
            engine = StepEngine.resume(saved["engine"].encode())
            engine.warmup = LIVE_WARMUP
            self.engine = engine
            self.roles = {int(k): int(v) for k, v in saved["roles"].items()}
            self.fed_seq = {str(k): int(v) for k, v in saved["fed_seq"].items()}
            dtype = header.record_dtype()
            held = {str(w): base64.b64decode(b, validate=True) for w, b in saved.get("held", {}).items()}
            catalogue = base64.b64decode(saved.get("catalogue", ""), validate=True)
            if any(len(raw) % dtype.itemsize or len(raw) > MAX_HELD * dtype.itemsize for raw in held.values()):
                raise ValueError("held records are not whole records")
            if len(catalogue) % dtype.itemsize:
                raise ValueError("the role catalogue is not whole records")
            self.held = {w: _as_columns(np.frombuffer(raw, dtype).copy()) for w, raw in held.items()}
            self.catalogue = _as_columns(np.frombuffer(catalogue, dtype).copy())
            # Version 1 fixed each communicator's role at first sight: those roles are settled.
            self.settled = bool(saved.get("settled", True))
            self.watermark = {str(w): (int(m[0]), int(m[1]), int(m[2])) for w, m in saved.get("watermark", {}).items()}
            self.late_records = int(saved.get("late_records", 0))
            self.sizes = {str(k): int(v) for k, v in saved["sizes"].items()}
            self.archived = {str(k): int(v) for k, v in saved.get("archived", {}).items()}
            open_bytes: dict[int, list[tuple[int, int]]] = {}
            for p, step, b in sorted(saved.get("bytes_acc", [])):
                open_bytes.setdefault(int(p), []).append((int(step), int(b)))
            self.open_bytes = {
                p: (np.array([x for x, _ in v], np.int64), np.array([y for _, y in v], np.int64))
                for p, v in open_bytes.items()
            }
            self.steps_total = {int(k): int(v) for k, v in saved.get("steps_total", {}).items()}
            self.latest = {int(k): v for k, v in saved.get("latest", {}).items()}
            self.recent = {k: deque([v], maxlen=RECENT_PER_RANK) for k, v in self.latest.items()}
        except FileNotFoundError:
            saved = None
        except (ValueError, KeyError, TypeError, CheckpointError) as exc:
            log.warning("step checkpoint %s unreadable (%s); step recovery starts afresh", self.checkpoint_path, exc)
            saved = None
            # Nothing of a half-read checkpoint stays: the state of a fresh agent.
            self.__dict__.update(LiveSteps(self.dir, self.host, self._pid_rank).__dict__)
        # Lines written after the checkpoint are written again from the replayed records: cut them.
        if self.dir.exists():
            for path in self.dir.glob("*.jsonl"):
                committed = self.sizes.get(path.name, 0)
                if path.stat().st_size > committed:
                    with open(path, "rb+") as handle:
                        handle.truncate(committed)
        if saved:
            log.info(
                "steps resumed: %d GPUs, %d summaries written before",
                len(self.engine.ranks),
                sum(self.steps_total.values()),
            )

    # ---- archives --------------------------------------------------------------------------------
    def unarchived(self) -> tuple[bytes, dict[str, int]]:
        """Summary lines written since the last seal (JSON lines), and the sizes they reach."""
        self.write_pending()
        chunks = []
        upto = {}
        for name, size in sorted(self.sizes.items()):
            start = self.archived.get(name, 0)
            if size <= start:
                continue
            with open(self.dir / name, "rb") as handle:
                handle.seek(start)
                chunks.append(handle.read(size - start))
            upto[name] = size
        return b"".join(chunks), upto

    def mark_archived(self, upto: dict[str, int]) -> None:
        self.archived.update(upto)
