"""The what-if replay's inputs, prepared window by window of whole steps (``analysis.stragglers``).

The straggler analysis prepares its events in windows of whole steps (``stragglers.prepare_window``: matching and
the per-event columns of each window). This module turns those columns into what the replay and the culprit
decision read, one window at a time, never holding the whole trace's events:

1. **Program order** (``ReplayInputs.add``, each window in step order): a window's events sorted by (rank, step,
   start, row); each event's previous operation on its rank, batch (operations posted at the same instant), group
   (collective or send with its receive), observed work, launch delay and, without host issue times, gap. A rank's
   first operation of a window follows its last one of an earlier window: that one is *carried* (per rank: its
   index, end, issue time, label, step and the step's begin), so the window needs nothing else of the past. Each
   window's arrays are written to an anonymous temporary file (``_Blocks``); per key, what the references need
   (the operations' and gaps' keys, the host-wait places, the atoms) is numbered through dictionaries shared by
   the windows.
2. **Host-wait votes** (host issue model only): per place in the program, the median of the time from the previous
   issue and from the previous end (``keyed_quantiles``, counting passes over the windows), then their mean
   absolute deviations (sums per place), decide whether the host waits; each window's gaps follow.
3. **References**: per key the lower quartile and median (``keyed_quantiles``) and the mean (sums and counts); in a
   pipeline without compute rows, per stage (``_stage_reference``).
4. **Planning** (``ReplayInputs.finish``): each window's healthy and mean durations and gaps, its excess over the
   median added into the per (rank, step) and per (atom, step) sums, its observed step ends, and its replay
   windows planned (``replay.plan_windows``) into one ``WindowStore``.

The report is that of one preparation over every event at once, to the bit: the sums behind the means and the
host-wait deviations are of integer nanoseconds (or halves, deviations from a median), exact in float64 in any
order; quantiles are exact; per (rank, step) and per (atom, step) cells lie in one window, added in the same order.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import polars as pl

from comminsight.analysis import replay as replay_module
from comminsight.analysis.keyed_quantiles import keyed_quantiles

WAIT_CLOCK_SLACK_NS = 50_000  # CPU issue times and GPU end times come from different clocks
NOISE_MULTIPLE = 3.0  # host-wait votes: standard errors by which the slope must fall short of one half
SINGLE = np.int64(1) << 62  # group ids of events that form no group: after every matched group's, in event order
# What a window passes to the next per rank: its last operation's (global) index, end, issue time, label, step and
# the step's begin.
_CARRIED_OUT = ("index", "e", "q", "label", "step", "step_start")


class _Blocks:
    """Dicts of 1-D arrays written one after another to an anonymous temporary file; read back by index and name (a
    pass reads only the arrays it needs)."""

    def __init__(self) -> None:
        self._file = tempfile.TemporaryFile()  # noqa: SIM115 (closed and gone when collected)
        self._layout: list[dict[str, tuple[int, str, int]]] = []

    def __len__(self) -> int:
        return len(self._layout)

    def append(self, arrays: dict[str, np.ndarray]) -> None:
        offset = self._file.seek(0, 2)
        layout = {}
        for name, values in arrays.items():
            data = np.ascontiguousarray(values).tobytes()
            layout[name] = (offset, values.dtype.str, values.size)
            self._file.write(data)
            offset += len(data)
        self._layout.append(layout)

    def read(self, index: int, names: tuple[str, ...]) -> dict[str, np.ndarray]:
        out = {}
        for name in names:
            offset, dtype, count = self._layout[index][name]
            self._file.seek(offset)
            buffer = bytearray(count * np.dtype(dtype).itemsize)
            self._file.readinto(buffer)
            out[name] = np.frombuffer(buffer, dtype, count)
        return out

    def each(self, *names: str) -> Iterator[dict[str, np.ndarray]]:
        for i in range(len(self)):
            yield self.read(i, names)


class _Ids:
    """Dense ids (0, 1, ...) of tuples of integers, numbered as first seen across windows."""

    def __init__(self) -> None:
        self.ids: dict[tuple[int, ...], int] = {}

    def __len__(self) -> int:
        return len(self.ids)

    def __call__(self, *columns: np.ndarray) -> np.ndarray:
        n = columns[0].size
        if n == 0:
            return np.zeros(0, np.int32)
        order = np.lexsort(columns[::-1])
        new = np.ones(n, dtype=bool)
        new[1:] = np.any([c[order][1:] != c[order][:-1] for c in columns], axis=0)
        first = order[new]
        unique = zip(*(c[first].tolist() for c in columns), strict=True)
        ids = np.array([self.ids.setdefault(tuple(u), len(self.ids)) for u in unique], np.int32)
        out = np.empty(n, np.int32)
        out[order] = ids[np.cumsum(new) - 1]
        return out

    def keys(self) -> np.ndarray:
        """The tuples by id (rows)."""
        return np.array(list(self.ids), np.int64).reshape(len(self.ids), -1)


def _gather(prev: np.ndarray, carried: np.ndarray, local: np.ndarray, carry: np.ndarray, default: Any) -> np.ndarray:
    """Per event, the value of its previous operation: ``local[prev]`` inside the window, ``carry`` (per event, the
    rank's carried value) when it lies in an earlier window, else ``default``."""
    inside = local[np.maximum(prev, 0)] if local.size else local
    return np.where(prev >= 0, inside, np.where(carried, carry, default))


def _key_sums(key: np.ndarray, values: np.ndarray, n_keys: int) -> tuple[np.ndarray, np.ndarray]:
    ok = ~np.isnan(values)
    return (
        np.bincount(key[ok], weights=values[ok], minlength=n_keys),
        np.bincount(key[ok], minlength=n_keys),
    )


class ReplayInputs:
    """The replay's inputs of a job, prepared window by window (module doc). ``add`` each window's columns
    (``stragglers._prepare_window``, strings and groups numbered across the job) in step order, then ``finish``."""

    def __init__(self, issue_model: bool) -> None:
        self.issue_model = issue_model
        self.blocks = _Blocks()
        self.n = 0  # events so far (the next window's first global index)
        self.offsets: list[int] = []
        self.steps: list[np.ndarray] = []  # per window, its step ids
        self.begins: list[np.ndarray] = []  # and their begins
        self.observed: list[np.ndarray] = []  # and the last observed end of each, relative to its begin
        self.longest = 1
        self.any_launch = False
        self.any_compute = False
        self.ranks: set[int] = set()
        self.work_keys, self.gap_keys, self.places, self.atoms = _Ids(), _Ids(), _Ids(), _Ids()
        self.atom_counts = np.zeros(0, np.int64)
        self.comm_keys: set[tuple[int, int]] = set()  # (work key, communicator) of matched communication
        floats = ("e", "q", "step_start")
        self.carry = {name: np.zeros(0, np.float64 if name in floats else np.int64) for name in _CARRIED_OUT}

    def _carried(self, ranks: np.ndarray) -> dict[str, np.ndarray]:
        size = int(ranks.max(initial=-1)) + 1
        if size > self.carry["index"].size:
            grow = size - self.carry["index"].size
            for name, values in self.carry.items():
                fill = -1 if name == "index" else 0
                self.carry[name] = np.r_[values, np.full(grow, fill, values.dtype)]
        return {name: values[ranks] for name, values in self.carry.items()}

    def add(self, cols: dict[str, np.ndarray]) -> None:
        """Step 1 of the module doc for one window (the next in step order); ``cols`` is consumed."""
        order = np.lexsort((cols["row"], cols["s"], cols["step"], cols["rank"]))
        ev = {}
        for name in list(cols):
            values = cols.pop(name)
            ev[name] = values[order] if values.size else values
        del order
        n = ev["row"].size
        if n == 0:
            return
        off = self.n
        idx = np.arange(n)
        r = ev.pop("rank").astype(np.int64)
        st = ev.pop("step").astype(np.int64)
        s = ev.pop("s").astype(np.float64)
        e_observed = ev.pop("e")
        e = e_observed.astype(np.float64)
        same_rank = np.zeros(n, dtype=bool)
        same_rank[1:] = r[1:] == r[:-1]
        same = same_rank.copy()
        same[1:] &= st[1:] == st[:-1]
        self.longest = max(self.longest, int(np.diff(np.r_[np.flatnonzero(~same), n]).max(initial=1)))
        prev = np.where(same_rank, idx - 1, -1)
        batched = np.zeros(n, dtype=bool)
        batched[1:] = same[1:] & (s[1:] == s[:-1])
        head = np.maximum.accumulate(np.where(~batched, idx, 0))
        prev = np.where(batched, prev[head], prev)
        del same_rank, same, batched
        # A rank's first batch of the window follows its last operation of an earlier window, if any.
        carry = self._carried(r)
        carried = (prev < 0) & (carry["index"] >= 0)
        has_prev = (prev >= 0) | carried
        prev_global = np.where(prev >= 0, off + prev, np.where(carried, carry["index"], -1))
        # Steps lie whole in a window: each step's begin (its first start) is the window's.
        step_ids, inv = np.unique(st, return_inverse=True)
        begin = np.full(step_ids.size, np.inf)
        np.minimum.at(begin, inv, s)
        step_start = begin[inv]
        hi = np.full(step_ids.size, -np.inf)
        np.maximum.at(hi, inv, e_observed.astype(np.float64) - step_start)
        self.steps.append(step_ids)
        self.begins.append(begin)
        self.observed.append(hi)
        del inv, e_observed
        shift = np.where(has_prev, _gather(prev, carried, step_start, carry["step_start"], 0.0) - step_start, 0.0)
        label = ev.pop("label").astype(np.int64)
        prev_label = np.where(has_prev, _gather(prev, carried, label, carry["label"], 0), 0)
        occurrence = ev.pop("occurrence").astype(np.int64)
        prev_end = np.where(has_prev, _gather(prev, carried, e, carry["e"], 0.0), s)
        block: dict[str, np.ndarray] = {}
        q = np.zeros(0)
        if self.issue_model:
            q = ev.pop("q")
            q = np.minimum(np.maximum(q, np.where(~has_prev, s, -np.inf)), s)
            prev_q = np.where(has_prev, _gather(prev, carried, q, carry["q"], 0.0), s)
            # Numbered only where there is a previous operation (the votes read no other place).
            place = np.zeros(n, np.int32)
            program = ev.pop("program").view(np.int64)
            place[has_prev] = self.places(*(c[has_prev] for c in (program, prev_label, label, occurrence)))
            del program
            new_step = has_prev & (_gather(prev, carried, st, carry["step"], 0) != st)
            block |= {"q": q, "prev_q": prev_q, "prev_end": prev_end, "place": place, "new_step": new_step}
            block["has_prev"] = has_prev
            launch = np.maximum(s - np.maximum(q, np.where(has_prev, prev_end, -np.inf)), 0.0)
            self.any_launch |= bool(launch.any())
            block["launch"] = launch
        else:
            ev.pop("program")
            block["gap"] = np.maximum(s - prev_end, 0.0)
        # Groups: collectives and matched sends with their receives; a member that completed before the last member
        # arrived contradicts its match, and its group is replayed as local operations (see stragglers).
        grp = ev.pop("group").astype(np.int64)
        p2p = ev.pop("is_p2p")
        last_arrival = ev.pop("last_arrival")
        contradicted = (grp >= 0) & (e < last_arrival - WAIT_CLOCK_SLACK_NS)
        collective = (grp >= 0) & ~np.isin(grp, np.unique(grp[contradicted]))
        group = np.where(collective, grp, SINGLE + off + idx)
        matched = (grp >= 0) | p2p
        del contradicted, grp, p2p
        rows, partner_row = ev.pop("row"), ev.pop("partner_row")
        by_row = np.argsort(rows)
        at = np.minimum(np.searchsorted(rows, partner_row, sorter=by_row), n - 1)
        found = (partner_row >= 0) & (rows[by_row[at]] == partner_row)
        partner = np.where(found, by_row[at], -1)
        del rows, partner_row, by_row, at, found
        ready = np.where(collective & ~np.isnan(last_arrival), np.maximum(s, last_arrival), s)
        ready = np.where(partner >= 0, np.maximum(ready, s[np.maximum(partner, 0)]), ready)
        batch = np.unique(head, return_inverse=True)[1]
        batch_ready = np.full(int(batch.max()) + 1, -np.inf)
        np.maximum.at(batch_ready, batch, ready)
        work = np.maximum(e - np.maximum(ready, batch_ready[batch]), 0.0)
        del ready, batch_ready, last_arrival, partner, collective
        is_compute = ev.pop("is_compute")
        comm = ev.pop("comm").astype(np.int64)
        kind = ev.pop("kind").astype(np.int64)
        self.any_compute |= bool(is_compute.any())
        work_key = self.work_keys(label, occurrence)
        gap_key = self.gap_keys(prev_label, label, occurrence)
        comm_matched = matched & ~is_compute
        pairs = np.unique(np.stack([work_key[comm_matched], comm[comm_matched]], axis=1), axis=0)
        self.comm_keys.update(map(tuple, pairs.tolist()))
        atom = self.atoms(r, comm, kind, matched.astype(np.int8), is_compute.astype(np.int8))
        self.atom_counts = np.r_[self.atom_counts, np.zeros(len(self.atoms) - self.atom_counts.size, np.int64)]
        self.atom_counts += np.bincount(atom, minlength=len(self.atoms))
        self.ranks.update(np.unique(r).tolist())
        # What the next window holding each rank follows: the rank's last event here.
        last = np.flatnonzero(np.r_[r[1:] != r[:-1], True])
        ends = {"index": off + last, "e": e[last], "q": q[last] if q.size else np.zeros(last.size)}
        ends |= {"label": label[last], "step": st[last], "step_start": step_start[last]}
        for name, values in ends.items():
            self.carry[name][r[last]] = values
        index = np.int32 if off + n < 2**31 else np.int64
        block |= {
            "prev": prev_global.astype(np.int64),
            "group": group,
            "batch": (off + head).astype(np.int64),
            "rank": r.astype(np.int32),
            "step": st,
            "shift": shift,
            "start_offset": s - step_start,
            "work": work,
            "work_key": work_key,
            "gap_key": gap_key,
            "atom": atom.astype(index),
            "is_compute": is_compute,
        }
        self.blocks.append(block)
        self.offsets.append(off)
        self.n += n

    def observed_times(self) -> np.ndarray:
        """Per step, its observed time (from the previous step's last end to its own, ``replay.step_times``)."""
        if not self.steps:
            return np.zeros(0)
        return replay_module.iteration_times(
            {"step_begin": np.concatenate(self.begins)}, np.concatenate(self.observed)[None]
        )[0]

    # Step 2: host-wait votes.
    def _waits(self) -> np.ndarray:
        """Per place in the program (``places``): does the host wait for the previous operation to complete before
        issuing?

        Issuing after the previous operation ended does not prove a wait: a rank whose compute outlasts the
        operation (a straggler, or anyone when the operation was delayed) issues after the end anyway. Whether a
        host waits is a property of the program, so it is decided per place in it (the rank's program in the step,
        previous operation, operation, occurrence), over every rank and step running that program. A wait absorbs
        the previous operation's duration (issue to end: the others' lateness), so the time from the previous
        issue grows one for one with it; a host that issues on its own schedule does not see it. The growth is the
        slope of a resistant line (Tukey's: the medians of the time from the issue in the lower and the upper third
        of the instances by that duration, over the difference of their median durations). The host waits when the
        issue (nearly) always follows the end, unless the slope is below one half (halfway between the two) by more
        than ``NOISE_MULTIPLE`` standard errors (each median's from its third's robust spread): the issue following
        the end is itself the sign of a wait, and only evidence against it decides otherwise.

        Not a comparison of the spreads of the time from the end and from the issue (the mean absolute deviation
        until 2026-12-04; the interquartile range before): the machine decided it. A host that lags behind its
        program finds the previous operation complete (it waits less) and issues the next one late from the end but
        on time from the issue, and the machine's delays are one-sided and heavy-tailed: in fault-free simulated
        Megatron runs under load a pipeline stage's wait at a receive read as its compute and the stage was named
        (tests/data/simulated_megatron_clean_machine_slow, _stage1_lagging; docs/analysis-stragglers.md). Quantiles
        by counting passes over the windows (``keyed_quantiles``).
        """
        n_places = len(self.places)
        fields = ("place", "has_prev", "q", "prev_q", "prev_end")

        def instances() -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
            for b in self.blocks.each(*fields):
                ok = b["has_prev"]
                q, prev_q = b["q"][ok], b["prev_q"][ok]
                yield (
                    b["place"][ok],
                    q - prev_q,
                    b["prev_end"][ok] - prev_q,
                    q >= b["prev_end"][ok] - WAIT_CLOCK_SLACK_NS,
                )

        # The lower and upper thirds of each place's instances by the previous operation's duration (``took``).
        cuts = keyed_quantiles(lambda: ((p, took) for p, _, took, _ in instances()), n_places, (1 / 3, 2 / 3))

        def sides() -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
            # Per instance in a third: key place x 2 + (0 lower, 1 upper), its time from the issue and its duration.
            for p, issue, took, _ in instances():
                for side, inside in ((0, took <= cuts[p, 0]), (1, took >= cuts[p, 1])):
                    yield 2 * p[inside] + side, issue[inside], took[inside]

        n_keys = 2 * n_places
        took_med = keyed_quantiles(lambda: ((k, t) for k, _, t in sides()), n_keys, (0.5,))[:, 0]
        issue_med = keyed_quantiles(lambda: ((k, i) for k, i, _ in sides()), n_keys, (0.5,))[:, 0]
        mad = keyed_quantiles(lambda: ((k, np.abs(i - issue_med[k])) for k, i, _ in sides()), n_keys, (0.5,))[:, 0]
        side_n = np.zeros(n_keys, np.int64)
        for k, _, _ in sides():
            side_n += np.bincount(k, minlength=n_keys)
        count, after = np.zeros(n_places, np.int64), np.zeros(n_places, np.int64)
        for p, _, _, is_after in instances():
            count += np.bincount(p, minlength=n_places)
            after += np.bincount(p, weights=is_after, minlength=n_places).astype(np.int64)
        # A median's variance from its third's robust spread: (1.2533 x 1.4826 x MAD)^2 / count.
        variance = (1.2533 * 1.4826 * np.nan_to_num(mad)) ** 2 / np.maximum(side_n, 1)
        took = np.nan_to_num(took_med[1::2] - took_med[0::2])
        grew = np.nan_to_num(issue_med[1::2] - issue_med[0::2])
        se = np.sqrt(variance[0::2] + variance[1::2])
        below_half = (took > 0) & (grew + NOISE_MULTIPLE * se < 0.5 * took)
        n = np.maximum(count, 1)
        return (count > 0) & (after / n >= 0.9) & ~below_half

    def _gap_sync(self, b: dict[str, np.ndarray], waits: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """A window's (gap, sync) per event."""
        if not self.issue_model:
            return b["gap"], np.ones(b["gap"].size, dtype=bool)
        has_prev, q, prev_end = b["has_prev"], b["q"], b["prev_end"]
        assert waits is not None
        sync = (has_prev & waits[b["place"]] & (q >= prev_end)) | b["new_step"]
        gap = np.maximum(q - np.where(sync | ~has_prev, prev_end, b["prev_q"]), 0.0)
        return gap, sync

    def finish(self, stage_of_rank: dict[int, int] | None) -> dict[str, Any]:
        """Steps 2-4 of the module doc: the arrays the replay and the culprit decision read (no per-event array but
        the planned windows'; with a dependency cycle, the whole-trace fallback's per-event arrays instead).
        ``stage_of_rank``: each rank's pipeline stage, when the job has stages."""
        waits = self._waits() if self.issue_model and self.n else None
        gap_names = ("gap",) if not self.issue_model else ("q", "prev_q", "prev_end", "place", "new_step", "has_prev")

        def gaps() -> Iterator[tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]]:
            for b in self.blocks.each(*gap_names, "rank", "gap_key", "work_key", "work", "step", "batch"):
                gap, sync = self._gap_sync(b, waits)
                yield b, gap, sync

        step_ids = np.concatenate(self.steps) if self.steps else np.zeros(0, np.int64)
        step_begin = np.concatenate(self.begins) if self.begins else np.zeros(0)
        rank_ids = np.array(sorted(self.ranks), np.int64)
        stage = None
        if stage_of_rank is not None:
            stage = np.full(int(max([*self.ranks, *stage_of_rank], default=0)) + 1, -1, np.int64)
            for rank, value in stage_of_rank.items():
                stage[rank] = value
        n_work, n_gap = len(self.work_keys), len(self.gap_keys)
        work_q = keyed_quantiles(lambda: ((b["work_key"], b["work"]) for b, _, _ in gaps()), n_work, (0.25, 0.5))
        work_sums, gap_sums = (
            (np.zeros(n_work), np.zeros(n_work, np.int64)),
            (np.zeros(n_gap), np.zeros(n_gap, np.int64)),
        )
        all_sync = True
        for b, g, sync in gaps():
            work_sums = tuple(
                x + y for x, y in zip(work_sums, _key_sums(b["work_key"], b["work"], n_work), strict=True)
            )
            gap_sums = tuple(x + y for x, y in zip(gap_sums, _key_sums(b["gap_key"], g, n_gap), strict=True))
            all_sync &= bool(sync.all())
        work_mean = _means(*work_sums)
        stage_ref = None
        if stage is not None and not self.any_compute:
            stage_ref = _StageReference.build(gaps, stage)
        if stage_ref is None:
            gap_q = keyed_quantiles(lambda: ((b["gap_key"], g) for b, g, _ in gaps()), n_gap, (0.25, 0.5))
            gap_mean = _means(*gap_sums)
        # Atoms by their sorted tuples (rank, communicator, kind, matched, compute): one numbering of the job.
        tuples = self.atoms.keys()
        by_tuple = np.lexsort(tuples.T[::-1]) if tuples.size else np.zeros(0, np.int64)
        atom_id = np.empty(by_tuple.size, np.int64)
        atom_id[by_tuple] = np.arange(by_tuple.size)
        ordered = tuples[by_tuple] if tuples.size else np.zeros((0, 5), np.int64)
        n_atoms, n_steps = by_tuple.size, step_ids.size
        arrays: dict[str, Any] = {
            "step_ids": step_ids,
            "step_begin": step_begin,
            "rank_ids": rank_ids,
            "gaps_are_compute": np.bool_(not self.any_compute),
            "max_chain": np.int64(4 * self.longest),
            "max_chain_all": np.int64(4 * self.longest * max(n_steps, 1)),
            "atom_count": np.zeros(n_atoms, np.int64),
            "atom_rank": ordered[:, 0],
            "atom_comm_id": ordered[:, 1],
            "atom_kind_id": ordered[:, 2],
            "atom_matched": ordered[:, 3].astype(bool),
            "atom_compute": ordered[:, 4].astype(bool),
            "alone": self._comms_without_peers(),
        }
        arrays["atom_count"][atom_id] = self.atom_counts
        per = np.zeros((rank_ids.size, n_steps))
        atom_sums = {name: np.zeros(n_atoms * n_steps) for name in ("work", "gap")}
        rank_stage = np.full(rank_ids.size, -1, dtype=np.int64)
        fast = all_sync and not self.any_launch
        more_names = ("prev", "group", "shift", "start_offset", "atom", *(("launch",) if self.issue_model else ()))

        def windows() -> Iterator[tuple[int, dict[str, np.ndarray], dict[str, tuple[np.ndarray, Any]]]]:
            """Per window: its first step's position, its replay arrays and its columns (``plan_windows``)."""
            step_lo = 0
            for w, (b, g, sync) in enumerate(gaps()):
                more = self.blocks.read(w, more_names)
                step_index = step_lo + np.searchsorted(self.steps[w], b["step"])
                work = b["work"]
                if stage_ref is None:
                    k = b["gap_key"]
                    q_gap, med_gap, mean_gap = gap_q[k, 0], gap_q[k, 1], gap_mean[k]
                else:
                    q_gap, med_gap, mean_gap = stage_ref.per_event(b, g)
                k = b["work_key"]
                q_work, med_work, mean_work = work_q[k, 0], work_q[k, 1], work_mean[k]
                window = {
                    "prev": more["prev"],
                    "group_dense": more["group"],
                    "batch": b["batch"],
                    "rank": b["rank"],
                    "step": b["step"],
                    "step_index": step_index,
                    "shift": more["shift"],
                    "sync": sync,
                    "launch": more["launch"] if self.issue_model else np.zeros(work.size),
                    "max_chain": arrays["max_chain"],
                    "max_chain_all": arrays["max_chain_all"],
                    "excess_gap": np.nan_to_num(g - med_gap),
                    "excess_work": np.nan_to_num(work - med_work),
                }
                columns = {
                    "work32": (work, np.float32),
                    "ideal_work32": (np.where(np.isnan(q_work), work, np.minimum(work, q_work)), np.float32),
                    "gap32": (g, np.float32),
                    "ideal_gap32": (np.where(np.isnan(q_gap), g, np.minimum(g, q_gap)), np.float32),
                    "start_offset32": (more["start_offset"], np.float32),
                    # The what-if study's ideal: every operation at its mean over ranks and steps.
                    "mean_gap": (np.where(np.isnan(mean_gap), g, mean_gap), np.float64),
                    "mean_work": (np.where(np.isnan(mean_work), work, mean_work), np.float64),
                    "start_offset": (more["start_offset"], np.float64),
                    "atom": (atom_id[more["atom"]], np.int32 if n_atoms < 2**31 else np.int64),
                }
                yield step_lo, window, columns
                step_lo += self.steps[w].size

        store = replay_module.WindowStore(spill=True)
        planned = True
        for w, (step_lo, window, columns) in enumerate(windows()):
            # Per (rank, step) and per (atom, step): the summed excess over the median, in step order (each step's
            # events in program order), as over the whole trace: a cell lies in one window.
            events = np.argsort(window["step_index"], kind="stable")
            step_index = window["step_index"][events]
            ranks = window["rank"][events]
            rank_index = np.searchsorted(rank_ids, ranks)
            excess = {name: window.pop(f"excess_{name}")[events] for name in ("work", "gap")}
            np.add.at(per, (rank_index, step_index), excess["work"] + excess["gap"])
            cell = columns["atom"][0][events].astype(np.int64) * n_steps + step_index
            for name, values in excess.items():
                atom_sums[name] += np.bincount(cell, weights=values, minlength=n_atoms * n_steps)
            if stage is not None:
                rank_stage[rank_index] = stage[ranks]
            if planned:
                n_steps_w = self.steps[w].size
                planned = replay_module.plan_windows(
                    window, self.offsets[w], step_lo, n_steps_w, rank_ids, store, columns, fast
                )
        arrays["rank_excess"] = per
        for name, values in atom_sums.items():
            arrays[f"atom_excess_{name}"] = values.reshape(n_atoms, n_steps)
        if stage_ref is not None:
            arrays["rank_stage"] = rank_stage
        arrays["carried"] = int(rank_ids.size)
        arrays["plan"] = store if planned else None
        if not planned:
            del store
            arrays |= _whole_trace(windows(), step_begin.size)
        return arrays

    def _comms_without_peers(self) -> set[int]:
        """Communicators (ids) none of whose matched operations is compared with another communicator's.

        A transfer's typical duration is that of the same operation (work key) on every rank and step; all members
        of one collective share one transfer, so for a communicator alone of its kind (the one data-parallel group
        of a ZeRO/FSDP job) the only reference is its own transfers in other steps. Whatever its noise, it then
        "saves" what separates its durations from their lower quartile, consistently when the noise is skewed (a
        collective lasts as long as its slowest member's hiccup: with heavy-tailed noise on 64 ranks, 1-2% of every
        step), and a slow link on it is indistinguishable from its network's normal speed. Such a communicator is
        no culprit candidate: no evidence separates it from the job's own noise. Its ranks still are.
        """
        communicators: dict[int, set[int]] = {}
        for key, comm in self.comm_keys:
            communicators.setdefault(key, set()).add(comm)
        every = {comm for _, comm in self.comm_keys}
        with_peers = {c for comms in communicators.values() if len(comms) > 1 for c in comms}
        return every - with_peers


def _means(sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Per key, the mean (NaN without values)."""
    return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def _whole_trace(
    windows: Iterator[tuple[int, dict[str, np.ndarray], dict[str, tuple[np.ndarray, Any]]]], n_steps: int
) -> dict[str, Any]:
    """The per-event arrays of the whole-trace replay (``replay.replay`` without a plan: a dependency cycle, from
    matching errors), every window's events in one numbering."""
    parts = [(window, {name: values for name, (values, _) in columns.items()}) for _, window, columns in windows]
    out: dict[str, Any] = {}
    for name in ("prev", "group_dense", "batch", "shift", "sync", "launch", "step_index"):
        out[name] = np.concatenate([w[name] for w, _ in parts])
    for name in parts[0][1]:
        out[name] = np.concatenate([c[name] for _, c in parts])
    out["group_dense"] = np.unique(out["group_dense"], return_inverse=True)[1]
    out["batch"] = np.unique(out["batch"], return_inverse=True)[1]
    for name in ("work", "gap", "ideal_work", "ideal_gap"):
        out[name] = out[f"{name}32"].astype(np.float64)
    order = np.argsort(out["step_index"], kind="stable")
    out["step_order"] = order
    out["step_cuts"] = np.searchsorted(out["step_index"][order], np.arange(n_steps))
    return out


class _StageReference:
    """The reference a compute gap is compared with in a pipeline without compute rows (``stragglers``' "Compute
    gaps in a pipeline"): the same place of the same stage's program, the stages scaled to the job's typical compute
    per step. Built from passes over the windows (``gaps``); ``per_event`` gives a window's (lower quartile, median,
    mean) per event."""

    def __init__(self, stage: np.ndarray, keys: _Ids, q: np.ndarray, mean: np.ndarray, totals: np.ndarray) -> None:
        self.stage, self.keys, self.q, self.mean, self.totals = stage, keys, q, mean, totals
        self.references: tuple[float, float, float] = (0.0, 0.0, 0.0)

    @classmethod
    def build(cls, gaps: Any, stage: np.ndarray) -> _StageReference | None:
        valid_stages: set[int] = set()
        keys = _Ids()
        for b, _, _ in gaps():
            s = stage[b["rank"]]
            valid_stages.update(np.unique(s[s >= 0]).tolist())
            keys(s, b["gap_key"])
        if len(valid_stages) < 2:
            return None

        def parts() -> Iterator[tuple[np.ndarray, np.ndarray]]:
            for b, g, _ in gaps():
                yield keys(stage[b["rank"]], b["gap_key"]), g

        q = keyed_quantiles(parts, len(keys), (0.25, 0.5))
        sums, counts = np.zeros(len(keys)), np.zeros(len(keys), np.int64)
        for k, g in parts():
            a, c = _key_sums(k, g, len(keys))
            sums, counts = sums + a, counts + c
        # Per (rank, step): the typical compute of the program it ran (operations posted together share one gap:
        # counted once); a (rank, step) lies in one window.
        frames = []
        for b, _, _ in gaps():
            s = stage[b["rank"]]
            head = np.r_[True, b["batch"][1:] != b["batch"][:-1]] if s.size else np.zeros(0, bool)
            med = q[keys(s, b["gap_key"]), 1]
            rs = pl.DataFrame(
                {
                    "rank": b["rank"].astype(np.int64),
                    "step": b["step"],
                    "stage": s,
                    "typical": np.where(head, np.nan_to_num(med), 0.0),
                }
            ).filter(pl.col("stage") >= 0)
            frames.append(rs.group_by("rank", "step").agg(pl.col("stage").first(), pl.col("typical").sum()))
        per_rank_step = pl.concat(frames)
        per_stage = per_rank_step.group_by("stage").agg(pl.col("typical").median())
        stages = per_stage.get_column("stage").to_numpy()
        totals = per_stage.get_column("typical").to_numpy()
        if totals.size == 0 or totals.min() <= 0:
            return None
        # Over ranks: each stage counts as many times as it has ranks.
        by_rank = (
            per_rank_step.group_by("rank")
            .agg(pl.col("stage").first())
            .join(per_stage, on="stage")
            .sort("rank")  # a fixed order for the mean below (group_by's order varies from run to run)
            .get_column("typical")
            .to_numpy()
        )
        lookup = np.full(int(stages.max()) + 1, np.nan)
        lookup[stages] = totals
        ref = cls(stage, keys, q, _means(sums, counts), lookup)
        ref.references = (float(np.quantile(by_rank, 0.25)), float(np.median(by_rank)), float(by_rank.mean()))
        return ref

    def per_event(self, b: dict[str, np.ndarray], gap: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        stage = self.stage[b["rank"]]
        k = self.keys(stage, b["gap_key"])
        valid = stage >= 0
        own = np.where(valid, self.totals[np.maximum(stage, 0)], np.nan)

        def scaled(values: np.ndarray, reference: float, clip: bool) -> np.ndarray:
            factor = reference / own
            if clip:
                factor = np.minimum(factor, 1.0)
            return np.where(valid, values * factor, values)

        q_ref, med_ref, mean_ref = self.references
        return (
            scaled(self.q[k, 0], q_ref, True),
            scaled(self.q[k, 1], med_ref, False),
            scaled(self.mean[k], mean_ref, False),
        )
