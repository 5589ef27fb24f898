"""The semantic engine: recover training steps from each rank's communication sequence.

Per rank, events (communication only, in time order) become signatures; the rank's first
``warmup`` events choose the method (the best-fitting template, else period detection; with
``check_templates``, a template that cuts the rank's period into less regular pieces loses to period
detection), then a two-state machine (see comminsight.semantic.templates) marks where steps open. Everything is
numpy over arrays of codes: a chunk costs a few vectorised passes, never a Python object per
event.

Streaming: ``StepEngine.feed(chunk)`` takes events in any chunking (each rank's events in time
order across chunks) and returns what became certain: per-event step ids and the step summaries
that are now final. State is bounded (the warm-up buffer, the current unconfirmed run, the
open steps of the stable window) and ``checkpoint()`` serialises it after any chunk;
``StepEngine.resume(blob)`` continues exactly as if there had been no stop. A step is final
once ``window`` later steps have opened on that rank (or at ``flush()``).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from functools import cache
from itertools import pairwise
from typing import Any

import numpy as np
import polars as pl

from comminsight.semantic.period import Period, coarse_signatures, detect_period, same_program_share
from comminsight.semantic.roles import N_SIGNATURES, ROLES
from comminsight.semantic.templates import END, NEUTRAL, START, Template, builtin_templates

CHECKPOINT_VERSION = 1
MAX_CHECKPOINT_BYTES = 256 << 20
MAX_PENDING = 1 << 16  # events held while a run is undecided; beyond this they are assigned as is
# A rank that fits no method after ``warmup`` events is retried each time its buffer doubles, up to
# this many times ``warmup`` (a step longer than the warm-up: hundreds of operations per step, a
# live engine's short warm-up); only then is it left without steps.
WARMUP_GROWTH = 8
N_ROLES = len(ROLES)
_ACC_COLS = 4 + N_ROLES  # start, last_end, n_ops, wait, then comm time per role
SUMMARY_COLUMNS = ("rank", "step", "start_ns", "end_ns", "last_op_end_ns", "n_ops", "wait_ns")
_FIELDS = ("row", "sig", "role", "start_ns", "end_ns", "wait_ns")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed; the message says why."""


@cache
def _tables(template: Template) -> tuple[np.ndarray, np.ndarray]:
    return template.tables()


_COARSE_OF = coarse_signatures(np.arange(N_SIGNATURES))


def _period_classes(anchor: int, anchor_prev: int, coarse: bool = False) -> np.ndarray:
    """Class per signature for a period anchor; ``coarse``: the anchors are coarse signatures (any size of theirs)."""
    if coarse:
        return _period_classes(anchor, anchor_prev)[_COARSE_OF]
    if anchor_prev < 0:
        # Every other signature ends the previous step, so each anchor occurrence opens one.
        cls = np.full(N_SIGNATURES, END, dtype=np.int8)
    else:
        # The anchor opens a step only right after its predecessor (others are ignored).
        cls = np.full(N_SIGNATURES, NEUTRAL, dtype=np.int8)
        cls[anchor_prev] = END
    cls[anchor] = START
    return cls


def find_starts(cls: np.ndarray, min_run: int, after_end: bool) -> tuple[np.ndarray, int, bool]:
    """Positions (into ``cls``) where steps open; also where undecided events begin and the state there.

    ``cls`` holds each event's class (NEUTRAL/START/END); ``after_end`` is the state before the
    first event (True at the start of a trace). Returns (starts, hold_from, after_end_at_hold).
    """
    n = len(cls)
    idx = np.flatnonzero(cls != NEUTRAL)
    if idx.size == 0:
        return np.empty(0, np.int64), n, after_end
    c = cls[idx]
    is_start = c == START
    prev = np.empty_like(c)
    prev[0] = END if after_end else START
    prev[1:] = c[:-1]
    run_begin = np.flatnonzero(is_start & (prev != START))
    preceded_by_end = np.ones(run_begin.size, dtype=bool)
    inner = run_begin > 0
    preceded_by_end[inner] = c[run_begin[inner] - 1] == END
    if run_begin.size and run_begin[0] == 0:
        preceded_by_end[0] = after_end
    # Run lengths: distance to the next non-start class (or the end).
    non_start = np.flatnonzero(~is_start)
    nxt = np.searchsorted(non_start, run_begin)
    if non_start.size == 0:  # only start events (a chunk inside a run): every run lasts to the end
        run_end = np.full(run_begin.size, c.size)
    else:
        run_end = np.where(nxt < non_start.size, non_start[np.minimum(nxt, non_start.size - 1)], c.size)
    length = run_end - run_begin
    ok = preceded_by_end & (length >= min_run)
    starts = idx[run_begin[ok]]
    hold_from = n
    if run_begin.size:
        last = run_begin.size - 1
        if preceded_by_end[last] and run_end[last] == c.size and length[last] < min_run:
            hold_from = int(idx[run_begin[last]])
    # State just before hold_from: the last non-neutral class before it.
    before = idx[idx < hold_from]
    state = after_end if before.size == 0 else bool(cls[before[-1]] == END)
    return starts.astype(np.int64), hold_from, state


def _spread(starts: np.ndarray) -> float:
    """Coefficient of variation of the times between consecutive step starts (0: perfectly regular)."""
    d = np.diff(starts).astype(np.float64)
    return float(d.std() / d.mean()) if d.size > 1 and d.mean() > 0 else float("inf")


@dataclass
class _Rank:
    """What the engine remembers about one rank between chunks."""

    method: str | None = None  # template name, "period", or "none"
    anchor: int = -1  # period anchor signature
    anchor_prev: int = -1  # signature that must precede the anchor (-1: none)
    min_run: int = 1  # anchors in a row (others of the anchor_prev class between) needed to open a step
    coarse: bool = False  # the anchors are coarse signatures (``coarse_signatures``)
    setup: int = 0  # leading events still to come that precede the periodic stretch (no step)
    retry_at: int = 0  # undecided: buffered events at which to try again (0: at ``warmup``)
    after_end: bool = True
    step: int = -1  # the step now open on this rank (-1: none yet)
    buffer: dict[str, np.ndarray] | None = None  # warm-up events, then the undecided tail
    # Open steps, oldest first: ids, and per step [start, last_end, n_ops, wait, comm ns per role...].
    open_ids: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    open_acc: np.ndarray = field(default_factory=lambda: np.empty((0, _ACC_COLS), np.int64))

    def empty_buffer(self) -> dict[str, np.ndarray]:
        return {f: np.empty(0, np.int64) for f in _FIELDS}


def _cat(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {f: np.concatenate((a[f], b[f])) for f in _FIELDS}


def _take(a: dict[str, np.ndarray], sl: slice) -> dict[str, np.ndarray]:
    return {f: a[f][sl] for f in _FIELDS}


class StepEngine:
    """Streaming, resumable step recovery over prepared event chunks (see module doc).

    A chunk is a mapping of equal-length int64 numpy arrays: ``rank``, ``row`` (the caller's
    event id, echoed back), ``sig`` and ``role`` (comminsight.semantic.roles), ``start_ns``,
    ``end_ns`` and optionally ``wait_ns`` (exposed waiting inside the operation).
    """

    def __init__(
        self,
        templates: list[Template] | None = None,
        warmup: int = 4096,
        window: int = 2,
        min_fit: float = 0.6,
        use_templates: bool = True,
        check_templates: bool = False,
    ) -> None:
        self.templates = list(templates) if templates is not None else builtin_templates()
        if not use_templates:
            self.templates = []
        self.warmup = int(warmup)
        self.window = max(1, int(window))
        self.min_fit = float(min_fit)
        # Roles read from the communicators' shape alone (no labels): a template may match misread roles,
        # so it must agree with the rank's own period (``_agrees_with_period``).
        self.check_templates = bool(check_templates)
        self.ranks: dict[int, _Rank] = {}

    # ----------------------------------------------------------------- choosing a method
    def _fit(self, template: Template, sig: np.ndarray) -> float:
        cls, tok = _tables(template)
        present = set(np.unique(tok[sig]).tolist()) - {-1}
        names = [t.name for t in template.tokens]
        have = {names[i] for i in present}
        if any(r not in have for r in template.requires):
            return 0.0
        if template.requires_any and not any(r in have for r in template.requires_any):
            return 0.0
        starts, _, _ = find_starts(cls[sig], template.min_run, True)
        if starts.size < 3:
            return 0.0
        lengths = np.diff(starts)
        mode_share = np.bincount(lengths).max() / lengths.size
        if mode_share < 1:  # lengths vary (a micro-batch count, an occasional operation): do the steps' operations?
            mode_share = max(mode_share, same_program_share(sig, starts))
        coverage = (len(sig) - starts[0]) / len(sig)
        return float(coverage * mode_share)

    def _decide(self, state: _Rank, ev: dict[str, np.ndarray]) -> None:
        sig = ev["sig"]
        best, best_score = None, self.min_fit
        for template in self.templates:
            score = self._fit(template, sig)
            if score > best_score + 1e-9:
                best, best_score = template, score
        if best is not None and not self.check_templates:
            state.method = best.name
            return
        found = detect_period(sig, ev["start_ns"], ev["end_ns"])
        if best is not None and self._agrees_with_period(best, found, ev):
            state.method = best.name
            return
        if found is None or found.period < 2:
            state.method = "none"
        else:
            state.method, state.anchor, state.anchor_prev = "period", found.anchor, found.anchor_prev
            state.min_run = found.min_run
            state.setup = found.setup
            state.coarse = found.coarse

    @staticmethod
    def _agrees_with_period(template: Template, found: Period | None, ev: dict[str, np.ndarray]) -> bool:
        """False when the template cuts the rank's period into several steps and the period's steps are more regular.

        With roles from shape alone, a template can match misread communicators: HSDP's shard groups
        (consecutive ranks) read as TP and its cross-group all-reduces as DP, so the megatron template
        ended a step at every layer's all-reduce. Those pieces are a fraction of the repeating program
        and last very different times (forward, backward, optimizer); the job's own period does not.
        """
        if found is None or found.period < 2:
            return True
        sig, start = ev["sig"], ev["start_ns"]
        cls, _ = _tables(template)
        t_starts, _, _ = find_starts(cls[sig], template.min_run, True)
        p_starts, _, _ = find_starts(
            _period_classes(found.anchor, found.anchor_prev, found.coarse)[sig[found.setup :]], found.min_run, True
        )
        p_starts = p_starts + found.setup
        if p_starts.size < 3 or t_starts.size < 1.5 * p_starts.size:
            return True  # about one template step per period: they agree
        return _spread(start[t_starts]) <= _spread(start[p_starts])

    def _classes(self, state: _Rank) -> tuple[np.ndarray, int]:
        if state.method == "period":
            return _period_classes(state.anchor, state.anchor_prev, state.coarse), state.min_run
        for template in self.templates:
            if template.name == state.method:
                return _tables(template)[0], template.min_run
        raise CheckpointError(f"template {state.method!r} is not loaded in this engine")

    # ----------------------------------------------------------------- feeding
    def feed(self, chunk: dict[str, np.ndarray]) -> dict[str, Any]:
        """Consume one chunk; return ``{"rows", "steps", "final"}`` that became certain.

        rows/steps: event ids and their step ids (-1 before the first step); final: list of
        columnar blocks of per-rank step summaries now final (``summaries_frame`` joins them):
        arrays SUMMARY_COLUMNS plus ``comm_ns`` (steps x roles) and ``method``.
        """
        n = len(chunk["rank"])
        ev_all = {f: np.asarray(chunk[f], dtype=np.int64) for f in _FIELDS if f in chunk}
        if "wait_ns" not in ev_all:
            ev_all["wait_ns"] = np.zeros(n, np.int64)
        rank = np.asarray(chunk["rank"], dtype=np.int64)
        order = np.argsort(rank, kind="stable") if n and np.any(np.diff(rank) < 0) else None
        if order is not None:
            rank = rank[order]
            ev_all = {f: v[order] for f, v in ev_all.items()}
        out_rows, out_steps, final = [], [], []
        if n:
            cuts = np.flatnonzero(np.diff(rank)) + 1
            bounds = np.concatenate(([0], cuts, [n]))
            for lo, hi in pairwise(bounds):
                r = int(rank[lo])
                rows, steps, fin = self._feed_rank(r, _take(ev_all, slice(lo, hi)), flush=False)
                out_rows.append(rows)
                out_steps.append(steps)
                final.extend(fin)
        return self._result(out_rows, out_steps, final)

    def flush(self) -> dict[str, Any]:
        """End of input: decide every rank still warming up and finalise every open step."""
        out_rows, out_steps, final = [], [], []
        for r in sorted(self.ranks):
            state = self.ranks[r]
            rows, steps, fin = self._feed_rank(r, state.empty_buffer(), flush=True)
            out_rows.append(rows)
            out_steps.append(steps)
            final.extend(fin)
        return self._result(out_rows, out_steps, final)

    @staticmethod
    def _result(rows: list, steps: list, final: list) -> dict[str, Any]:
        return {
            "rows": np.concatenate(rows) if rows else np.empty(0, np.int64),
            "steps": np.concatenate(steps) if steps else np.empty(0, np.int64),
            "final": final,
        }

    def _feed_rank(self, r: int, ev: dict[str, np.ndarray], flush: bool) -> tuple[np.ndarray, np.ndarray, list]:
        state = self.ranks.get(r)
        if state is None:
            state = self.ranks[r] = _Rank(buffer=None)
        if state.buffer is not None and len(state.buffer["row"]):
            ev = _cat(state.buffer, ev)
        state.buffer = None
        if state.method is None:
            need, limit = max(self.warmup, state.retry_at), self.warmup * WARMUP_GROWTH
            while True:
                if len(ev["row"]) < need and not flush:
                    state.retry_at = need
                    state.buffer = ev
                    return np.empty(0, np.int64), np.empty(0, np.int64), []
                self._decide(state, _take(ev, slice(0, need)))  # the first `need` events, however chunked
                if state.method != "none" or flush or need >= limit:
                    break
                # Nothing fits yet: perhaps a step is longer than what was seen. Look again at twice as many.
                state.method, need = None, min(2 * need, limit)
            state.retry_at = 0
        if state.method == "none":
            return ev["row"], np.full(len(ev["row"]), -1, np.int64), []
        cls_table, min_run = self._classes(state)
        cls = cls_table[ev["sig"]]
        if state.setup:
            # Set-up events (before the periodic stretch) open and close nothing: they stay before step 0.
            cls[: state.setup] = NEUTRAL
        starts, hold_from, after_end = find_starts(cls, min_run, state.after_end)
        if hold_from < len(ev["row"]) and (flush or len(ev["row"]) - hold_from > MAX_PENDING):
            # End of input (or a run held too long): the undecided run is just part of the open step.
            marked = np.flatnonzero(cls != NEUTRAL)
            after_end = bool(cls[marked[-1]] == END) if marked.size else state.after_end
            hold_from = len(ev["row"])
        if hold_from < len(ev["row"]):
            state.buffer = _take(ev, slice(hold_from, None))
            ev = _take(ev, slice(0, hold_from))
        state.after_end = after_end
        m = len(ev["row"])
        state.setup = max(0, state.setup - m)
        base = state.step
        # Step of each event = steps opened at or before it: a running count of the starts (starts are distinct).
        opened = np.zeros(m, np.int64)
        opened[starts[starts < m]] = 1
        step = base + np.cumsum(opened)
        self._accumulate(state, ev, step, starts, base)
        final = self._finalise(r, state, flush)
        return ev["row"], step, final

    def _accumulate(
        self, state: _Rank, ev: dict[str, np.ndarray], step: np.ndarray, starts: np.ndarray, base: int
    ) -> None:
        m = len(step)
        if m == 0:
            return
        k = step - base  # 0 = the step already open, 1.. = steps opened in this batch
        nk = int(starts.size) + 1
        acc = np.zeros((nk, _ACC_COLS), np.int64)
        acc[:, 2] = np.bincount(k, minlength=nk)
        acc[:, 3] = np.bincount(k, weights=ev["wait_ns"], minlength=nk).astype(np.int64)
        dur = (ev["end_ns"] - ev["start_ns"]).astype(np.float64)
        acc[:, 4:] = np.bincount(k * N_ROLES + ev["role"], weights=dur, minlength=nk * N_ROLES).reshape(nk, N_ROLES)
        last_end = np.full(nk, np.iinfo(np.int64).min)
        # k never decreases (steps open in order): a maximum per run of equal k, not a scatter (ufunc.at).
        runs = np.concatenate(([0], np.flatnonzero(np.diff(k)) + 1))
        last_end[k[runs]] = np.maximum.reduceat(ev["end_ns"], runs)
        acc[:, 1] = last_end
        acc[1:, 0] = ev["start_ns"][starts]
        if base >= 0 and acc[0, 2] and state.open_ids.size and state.open_ids[-1] == base:
            # Merge into the step that was already open (the newest open row).
            cur = state.open_acc[-1]
            cur[1] = max(cur[1], acc[0, 1])
            cur[2:] += acc[0, 2:]
        if nk > 1:
            state.open_ids = np.concatenate((state.open_ids, base + np.arange(1, nk, dtype=np.int64)))
            state.open_acc = np.concatenate((state.open_acc, acc[1:]))
        state.step = base + int(starts.size)

    def _finalise(self, r: int, state: _Rank, flush: bool) -> list[dict]:
        ids = state.open_ids
        if ids.size == 0:
            return []
        cut = ids.size if flush else int(np.searchsorted(ids, state.step - self.window, side="right"))
        if cut == 0:
            return []
        acc = state.open_acc
        # A step ends where the next one starts on this rank; the newest ends at its last operation.
        nxt_start = np.empty(ids.size, np.int64)
        nxt_start[:-1] = acc[1:, 0]
        nxt_start[-1] = acc[-1, 1]
        block = {
            "rank": np.full(cut, r, np.int64),
            "step": ids[:cut].copy(),
            "start_ns": acc[:cut, 0].copy(),
            "end_ns": nxt_start[:cut],
            "last_op_end_ns": acc[:cut, 1].copy(),
            "n_ops": acc[:cut, 2].copy(),
            "wait_ns": acc[:cut, 3].copy(),
            "comm_ns": acc[:cut, 4:].copy(),
            "method": state.method,
        }
        state.open_ids = ids[cut:].copy()
        state.open_acc = acc[cut:].copy()
        return [block]

    # ----------------------------------------------------------------- checkpoints
    def checkpoint(self) -> bytes:
        """The engine's whole state as bytes (JSON); resume with ``StepEngine.resume``."""
        ranks = {}
        for r, st in self.ranks.items():
            ranks[str(r)] = {
                "method": st.method,
                "anchor": st.anchor,
                "anchor_prev": st.anchor_prev,
                "min_run": st.min_run,
                "coarse": st.coarse,
                "setup": st.setup,
                "retry_at": st.retry_at,
                "after_end": st.after_end,
                "step": st.step,
                "buffer": None
                if st.buffer is None
                else {f: base64.b64encode(st.buffer[f].astype("<i8").tobytes()).decode() for f in _FIELDS},
                "open_ids": st.open_ids.tolist(),
                "open_acc": st.open_acc.tolist(),
            }
        doc = {
            "version": CHECKPOINT_VERSION,
            "templates": [t.name for t in self.templates],
            "warmup": self.warmup,
            "window": self.window,
            "min_fit": self.min_fit,
            "check_templates": self.check_templates,
            "ranks": ranks,
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def resume(cls, blob: bytes, templates: list[Template] | None = None) -> StepEngine:
        """An engine continuing from ``checkpoint()`` output; ``templates`` must include those it used."""
        if len(blob) > MAX_CHECKPOINT_BYTES:
            raise CheckpointError("checkpoint is larger than the limit")
        try:
            doc = json.loads(blob)
        except (ValueError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"checkpoint is not JSON: {exc}") from exc
        if not isinstance(doc, dict) or doc.get("version") != CHECKPOINT_VERSION:
            raise CheckpointError(f"checkpoint version is not {CHECKPOINT_VERSION}")
        try:
            engine = cls(
                templates=templates,
                warmup=int(doc["warmup"]),
                window=int(doc["window"]),
                min_fit=float(doc["min_fit"]),
                check_templates=bool(doc.get("check_templates", False)),
            )
            known = {t.name for t in engine.templates}
            missing = [n for n in doc["templates"] if n not in known]
            if missing:
                raise CheckpointError(f"checkpoint used templates that are not loaded: {missing}")
            engine.templates = [t for t in engine.templates if t.name in set(doc["templates"])]
            for key, st in doc["ranks"].items():
                buf = None
                if st["buffer"] is not None:
                    buf = {
                        f: np.frombuffer(base64.b64decode(st["buffer"][f], validate=True), "<i8").astype(np.int64)
                        for f in _FIELDS
                    }
                    if len({len(v) for v in buf.values()}) != 1:
                        raise CheckpointError("checkpoint buffer columns differ in length")
                    if np.any((buf["sig"] < 0) | (buf["sig"] >= N_SIGNATURES)) or np.any(
                        (buf["role"] < 0) | (buf["role"] >= N_ROLES)
                    ):
                        raise CheckpointError("checkpoint buffer holds invalid signatures")
                open_ids = np.asarray(st["open_ids"], dtype=np.int64).reshape(-1)
                open_acc = np.asarray(st["open_acc"], dtype=np.int64).reshape(-1, _ACC_COLS)
                if open_ids.size != open_acc.shape[0] or np.any(np.diff(open_ids) != 1):
                    raise CheckpointError("checkpoint open steps are malformed")
                method = st["method"]
                if method is not None and method not in ("period", "none") and method not in known:
                    raise CheckpointError(f"checkpoint rank uses unknown method {method!r}")
                anchor, anchor_prev = int(st["anchor"]), int(st.get("anchor_prev", -1))
                setup = int(st.get("setup", 0))
                min_run = int(st.get("min_run", 1))
                if not 1 <= min_run <= 1024:
                    raise CheckpointError("checkpoint period run length is out of range")
                if setup < 0:
                    raise CheckpointError("checkpoint set-up count is negative")
                if method == "period" and not (0 <= anchor < N_SIGNATURES and -1 <= anchor_prev < N_SIGNATURES):
                    raise CheckpointError("checkpoint period anchor is out of range")
                engine.ranks[int(key)] = _Rank(
                    method=method,
                    anchor=anchor,
                    anchor_prev=anchor_prev,
                    min_run=min_run,
                    coarse=bool(st.get("coarse", False)),
                    setup=setup,
                    retry_at=max(0, int(st.get("retry_at", 0))),
                    after_end=bool(st["after_end"]),
                    step=int(st["step"]),
                    buffer=buf,
                    open_ids=open_ids,
                    open_acc=open_acc,
                )
        except CheckpointError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"checkpoint is malformed: {exc!r}") from exc
        return engine


def summaries_frame(blocks: list[dict]) -> pl.DataFrame:
    """One row per (rank, step) from the engine's ``final`` blocks; comm time per role as columns."""
    if not blocks:
        schema = {c: pl.Int64 for c in SUMMARY_COLUMNS} | {f"comm_{r}_ns": pl.Int64 for r in ROLES}
        return pl.DataFrame(schema=schema | {"method": pl.String})
    cols: dict[str, Any] = {c: np.concatenate([b[c] for b in blocks]) for c in SUMMARY_COLUMNS}
    comm = np.concatenate([b["comm_ns"] for b in blocks])
    for i, role in enumerate(ROLES):
        cols[f"comm_{role}_ns"] = comm[:, i]
    cols["method"] = np.concatenate([np.full(len(b["step"]), b["method"], dtype=object) for b in blocks]).astype(str)
    return pl.DataFrame(cols)
