"""Live steps: the semantic engine fed by every record the agent consumes, per GPU (writer process).

Every completed Coll/P2P record goes, as one engine event, to the chunked ``StepEngine``
(comminsight.semantic). Once a step is final (``window`` later steps opened on that GPU), its
summary is appended as one JSON line to ``<home>/semantics/step/<host>-<pid>.jsonl``
(format: docs/formats/steps.md). The engine state, each file's committed size and, per writer,
the highest ``record_seq`` fed are checkpointed to ``<home>/semantics/step/checkpoint.json`` just
before the agent's ingest checkpoint: a restarted agent truncates each file to its checkpointed
size, resumes the engine, and skips records it already fed, so no step is lost or written twice.

Engine keys are writer pids (one process drives one GPU); the global rank (segment header
``RANK``) is attached when a summary is written. Roles are fixed per communicator the first time it
is seen (its name, else its shape), so signatures stay the same across chunks and restarts. While no
communicator has come with a name, roles are read from shape alone and the engine checks a winning
template against the GPU's own period, as offline recovery does (docs/semantic.md).
"""

from __future__ import annotations

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
from comminsight.importers.normalise import op_name
from comminsight.semantic import CheckpointError, StepEngine
from comminsight.semantic.roles import OP_CODE, ROLE_CODE, ROLES, infer_roles, roles_from_shape_alone, signatures

log = logging.getLogger("comminsight.agent.steps")
CHECKPOINT_VERSION = 1
LIVE_WARMUP = 512  # events per GPU before the engine picks a method (the offline default is 4096)
RECENT_PER_RANK = 64
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
        self.fed_seq: dict[str, int] = {}  # writer -> highest record_seq fed
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
        """Feed a batch of verified records of one writer; returns the step summaries written."""
        consts = header.constants()
        if len(records) == 0:
            return 0
        seq = records["record_seq"].astype(np.int64)
        keep = (seq > self.fed_seq.get(writer, -1)) & (records["state"] == consts["CI_STATE_COMPLETED"])
        if not keep.any():
            self.fed_seq[writer] = max(self.fed_seq.get(writer, -1), int(seq.max()))
            return 0
        recs = records[keep] if not keep.all() else records
        comm = recs["comm_hash"]
        # One code per (communicator, op name) pair: a batch of one GPU holds a handful of them, and role,
        # op and the signature's high part are functions of the pair.
        pair_first, pair_codes = _few_distinct(
            comm.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) ^ _string_key(recs["func"]), limit=32
        )
        comm_values = comm[pair_first].tolist()
        if any(int(c) not in self.roles for c in comm_values):
            self._learn_roles(recs)
        pair_role = np.array([self.roles[int(c)] for c in comm_values], np.int64)
        names = _text(recs["func"][pair_first])
        pair_op = np.array([OP_CODE.get(op_name(f), OP_CODE["other"]) for f in names], np.int64)
        role = pair_role[pair_codes]
        nbytes = recs["bytes"].astype(np.int64)
        zero = np.zeros(len(pair_first), np.int64)
        # signatures() is linear in its parts: the pair's part plus the size bucket's (role = op = 0).
        sig = signatures(pair_role, pair_op, zero)[pair_codes] + signatures(zero[:1], zero[:1], nbytes)
        gpu = (recs["flags"] & consts["CI_FLAG_GPU_TIMES"]) != 0
        start = np.where(gpu, recs["gpu_start_ns"], recs["enqueue_end_ns"]).astype(np.int64)
        end = np.where(gpu, recs["gpu_end_ns"], recs["complete_ns"]).astype(np.int64)
        pid = recs["pid"].astype(np.int64)
        one_writer = bool(pid[0] == pid[-1] and np.all(pid == pid[0]))  # as rings and segments give
        if one_writer:
            order = None if np.all(start[1:] >= start[:-1]) else np.argsort(start, kind="stable")
        else:
            order = np.lexsort((start, pid))
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
        out = self.engine.feed(chunk)
        written = self._emit(out, int(pid[0]) if one_writer else None)
        self.fed_seq[writer] = max(self.fed_seq.get(writer, -1), int(seq.max()))
        return written

    def _learn_roles(self, recs: Any) -> None:
        comms = np.unique(recs["comm_hash"])
        unknown = [int(c) for c in comms.tolist() if int(c) not in self.roles]
        if not unknown:
            return
        mask = np.isin(recs["comm_hash"], np.array(unknown, np.uint64))
        # One row per (communicator, writer, op) is all role inference needs.
        key = (
            _string_key(recs["func"][mask])
            ^ recs["comm_hash"][mask].astype(np.uint64)
            ^ recs["pid"][mask].astype(np.uint64)
        )
        _, first = np.unique(key, return_index=True)
        mask = np.flatnonzero(mask)[first]
        pids = recs["pid"][mask]
        catalogue = pl.DataFrame(
            {
                "comm_id": [f"0x{int(c):016x}" for c in recs["comm_hash"][mask].tolist()],
                "rank": [self.pid_rank.get(int(p), int(p)) for p in pids.tolist()],
                "op": [op_name(f) for f in _text(recs["func"][mask])],
                "is_p2p": (recs["kind"][mask] == header.constants()["CI_KIND_P2P"]).tolist(),
                "comm_desc": [n or None for n in _text(recs["comm_name"][mask])],
                "comm_size": recs["nranks"][mask].astype(np.int64).tolist(),
                "comm_ranks": pl.Series([None] * len(mask), dtype=pl.List(pl.Int64)),
            }
        ).unique(subset=["comm_id", "rank", "op"])
        if not roles_from_shape_alone(catalogue):
            self.engine.check_templates = False  # roles named by the job (kept in the engine's checkpoint)
        for comm_id, role in infer_roles(catalogue).items():
            self.roles[int(comm_id, 16)] = ROLE_CODE.get(role, 0)
        for c in unknown:
            self.roles.setdefault(c, 0)

    def flush(self) -> int:
        """End of the job on this node: finalise every open step (and write them)."""
        written = self._emit(self.engine.flush())
        self.write_pending()
        return written

    def _emit(self, out: dict[str, Any], only_pid: int | None = None) -> int:
        """Add the bytes of the batch's operations to their steps; queue the steps now final for writing.
        ``only_pid``: the batch was one writer's (the usual case), so rows need no grouping by writer."""
        rows, steps = out["rows"], out["steps"]
        ok = steps >= 0
        if only_pid is not None and len(steps) and steps[0] >= 0:  # steps never decrease: all are >= 0
            self._add_bytes(only_pid, steps, (rows & _BYTES_MASK).astype(np.int64))
        elif ok.any():
            pids = (rows[ok] >> _PID_SHIFT).astype(np.int64)
            nbytes = (rows[ok] & _BYTES_MASK).astype(np.int64)
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
            if saved.get("version") != CHECKPOINT_VERSION:
                raise ValueError(f"version {saved.get('version')!r}")
            engine = StepEngine.resume(saved["engine"].encode())
            engine.warmup = LIVE_WARMUP
            self.engine = engine
            self.roles = {int(k): int(v) for k, v in saved["roles"].items()}
            self.fed_seq = {str(k): int(v) for k, v in saved["fed_seq"].items()}
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
