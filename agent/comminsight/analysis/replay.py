"""The what-if replay of the straggler analysis, window by window of steps (``analysis.stragglers``).

The replay takes a job's operations (one row per event: the previous operation on its rank, its
group, its batch, its gap and work) and computes every event's end in many scenarios at once, level
by level of the dependency graph. Steps depend on each other only through program order: a rank's
first operation of a step follows its last one of the step before (``prev``). So the events are cut
into **windows** of whole steps, in order, and each window is replayed with its own level plan,
holding only its own events x scenarios; what a window needs from the windows before it is the
replayed end (and host issue time) of each rank's last operation before the window, per scenario (the
*carry*, one slot per rank). No collective, send/receive
pair or batch is cut by a window boundary (a window grows until none is), so every other dependency
lies inside one window, and the ends are exactly those of one replay of the whole trace.

Memory: the event x scenario arrays of a replay are those of one window and one chunk of scenarios
(``WINDOW_BUDGET``), plus the carry (ranks x scenarios); not the trace's length. The windows themselves (plans and
per-event inputs) are planned one at a time and kept in a ``WindowStore``, spilled to an anonymous temporary file
when there are several, and read back one at a time: between replays nothing per event stays in memory.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from itertools import pairwise
from typing import Any

import numpy as np

REPLAY_BUDGET = 64 << 20  # bytes of event x scenario arrays per replay chunk of the whole-trace fallback
WINDOW_BUDGET = 8 << 20  # bytes of event x scenario arrays per window and chunk
CHUNK_SCENARIOS = 64  # scenarios replayed together at most


def window_events() -> int:
    """Events per window (at least one step): a full chunk of scenarios over a window stays within
    ``WINDOW_BUDGET`` (about 32 bytes per event and scenario). Smaller windows cost next to nothing: the
    replay's levels are the same in number, only cut into more windows."""
    return WINDOW_BUDGET // (CHUNK_SCENARIOS * 4 * 8)


def step_windows(
    arrays: dict[str, Any], max_events: int | None = None, columns: dict[str, tuple[np.ndarray, Any]] | None = None
) -> WindowStore | None:
    """The replay's windows of whole steps, in step order, each with its level plan and its slices of ``columns``
    (per-event arrays, each stored as the dtype given beside it); None when the dependency graph has a cycle
    (matching errors: the whole trace is then iterated, see ``replay``). ``plan_windows`` over every event."""
    n_steps = int(arrays["step_ids"].size)
    rank_ids = np.unique(arrays["rank"])
    store = WindowStore(spill=_window_bounds(arrays, 0, n_steps, max_events).size > 2)
    fast = bool(arrays["sync"].all()) and not bool(arrays["launch"].any())
    if not plan_windows(arrays, 0, 0, n_steps, rank_ids, store, columns or {}, fast, max_events):
        return None
    arrays["carried"] = int(rank_ids.size)
    return store


def _window_bounds(arrays: dict[str, Any], step_lo: int, n_steps: int, max_events: int | None) -> np.ndarray:
    """Step positions (from ``step_lo``) where the windows of ``plan_windows`` begin, and ``n_steps`` at the end."""
    max_events = window_events() if max_events is None else max_events
    group, step_index = arrays["group_dense"], arrays["step_index"] - step_lo
    # Boundaries a group spans (members in several steps, e.g. recovered steps cut differently per rank).
    _, group = np.unique(group, return_inverse=True)
    n_groups = int(group.max(initial=-1)) + 1
    low = np.full(n_groups, n_steps, np.int64)
    high = np.zeros(n_groups, np.int64)
    np.minimum.at(low, group, step_index)
    np.maximum.at(high, group, step_index)
    spans = low < high
    open_count = np.zeros(n_steps + 1, np.int64)
    np.add.at(open_count, low[spans] + 1, 1)
    np.add.at(open_count, high[spans] + 1, -1)
    blocked = np.cumsum(open_count) > 0  # blocked[k]: no boundary between steps k - 1 and k
    per_step = np.bincount(step_index, minlength=n_steps)
    bounds, held = [0], 0
    for k in range(n_steps):
        if k > bounds[-1] and not blocked[k] and held + per_step[k] > max_events:
            bounds.append(k)
            held = 0
        held += int(per_step[k])
    bounds.append(n_steps)
    return np.array(bounds, np.int64)


def plan_windows(
    arrays: dict[str, Any],
    offset: int,
    step_lo: int,
    n_steps: int,
    rank_ids: np.ndarray,
    store: WindowStore,
    columns: dict[str, tuple[np.ndarray, Any]],
    fast: bool,
    max_events: int | None = None,
) -> bool:
    """Plan the replay's windows of whole steps over ``arrays``' events (those of steps ``step_lo`` to ``step_lo +
    n_steps - 1``, numbered from ``offset`` in ``prev``; an event whose previous operation lies before ``offset``
    follows the carry), in step order, each with its level plan and its slices of ``columns``, into ``store``;
    False when the dependency graph has a cycle.

    A window takes consecutive steps while it holds at most ``max_events`` events (at least one step), and never
    ends between two steps that a group (collective, send with its receive) spans. Each window is planned alone
    and handed to the store (``WindowStore``: spilled to a file when there is more than one), so planning holds
    one window's plan at a time. Between windows only each rank's last operation passes (the carry, one slot per
    rank of ``rank_ids``): a rank's operations of a window follow one another, the first one its last operation
    before it.
    """
    prev, group, batch, rank = arrays["prev"], arrays["group_dense"], arrays["batch"], arrays["rank"]
    n = prev.size
    step_index = arrays["step_index"] - step_lo
    bounds = _window_bounds(arrays, step_lo, n_steps, max_events)
    w_order = np.argsort(step_index, kind="stable")
    order, cuts = w_order, np.r_[np.searchsorted(step_index[w_order], np.arange(n_steps)), n]
    # The windows' indices are 32-bit while the trace allows it.
    index = np.int32 if offset + n < 2**31 else np.int64
    owner = np.full(n, -1, index)  # window of each event planned so far
    local = np.zeros(n, index)  # its index in the window
    for a, b in pairwise(bounds.tolist()):
        w = len(store)
        events = np.sort(order[cuts[a] : cuts[b]]).astype(index)
        owner[events] = w
        local[events] = np.arange(events.size)
        m = events.size
        p = prev[events] - offset
        own_rank = rank[events]
        outside = (p < 0) & (prev[events] >= 0)
        outside |= (p >= 0) & (owner[np.maximum(p, 0)] != w)
        # Earlier windows' events this window follows (ghosts): one per rank at most, known by the rank's slot.
        slot = np.searchsorted(rank_ids, own_rank[outside])
        ghosts = np.unique(slot)
        local_prev = np.where(p >= 0, local[np.maximum(p, 0)], -1)
        local_prev[outside] = m + np.searchsorted(ghosts, slot)
        batch_ids, local_batch = np.unique(batch[events], return_inverse=True)
        _, local_group = np.unique(group[events], return_inverse=True)
        nb = batch_ids.size
        # Ghosts: one batch each, after the window's own; their step never equals an own event's.
        step = arrays["step"][events]
        # The events are in program order (rank, step, start): each rank's last one here is what the next
        # window holding the rank follows.
        last = np.flatnonzero(np.r_[own_rank[1:] != own_rank[:-1], True]) if m else np.zeros(0, np.int64)
        win: dict[str, Any] = {
            "events": (events + offset).astype(index),
            "steps": (a + step_lo, b + step_lo),
            "prev": local_prev,
            "group_dense": local_group.astype(index),
            "batch": np.r_[local_batch, nb + np.arange(ghosts.size)].astype(index),
            "n_own_batches": nb,
            "step": np.r_[step, np.full(ghosts.size, step.min(initial=0) - 1)],
            "shift": arrays["shift"][events],
            "sync": arrays["sync"][events],
            "launch": arrays["launch"][events],
            "max_chain": arrays["max_chain"],
            "max_chain_all": arrays["max_chain_all"],
            "ghost_slots": ghosts,
            "export_slots": np.searchsorted(rank_ids, own_rank[last]),
            "exports": last.astype(index),
            "fast": fast,
        }
        plan = levels(win) if m else []
        if plan is None:
            return False
        win["plan"] = plan
        # Per-step maxima of the window's ends (its steps in order).
        steps = step_index[events]
        s_order = np.argsort(steps, kind="stable")
        win["step_order"] = s_order.astype(index)
        win["step_cuts"] = np.flatnonzero(np.r_[True, steps[s_order][1:] != steps[s_order][:-1]]) if m else s_order
        for name, (values, dtype) in columns.items():
            win[name] = values[events].astype(dtype)
        store.append(win)
    return True


class WindowStore:
    """The replay's planned windows, in step order: held in memory, or (``spill``) written one after another to an
    anonymous temporary file and read back one at a time, so that between replays only each window's size stays in
    memory, and during one the window it replays.

    A window is a dict of arrays, scalars and its level plan (``levels``); it is stored as one block of bytes (the
    arrays, 8-byte aligned) and a layout, and read back as views of one buffer. (``np.save``/``np.load`` per array
    gives the same report but, with a window's thousands of small level arrays, twice the analysis's CPU: 4.6 ->
    8.7 s on 128 ranks x 90 steps.)
    """

    def __init__(self, spill: bool) -> None:
        self._held: list[dict[str, Any]] = []
        # Closed, and gone from the disk, when the store is collected (the file has no name from the start).
        self._file = tempfile.TemporaryFile() if spill else None  # noqa: SIM115
        self._blocks: list[tuple[int, int, dict[str, Any]]] = []
        self.sizes: list[int] = []

    def __len__(self) -> int:
        return len(self.sizes)

    def append(self, win: dict[str, Any]) -> None:
        self.sizes.append(int(win["events"].size))
        if self._file is None:
            self._held.append(win)
            return
        named = [(k, v) for k, v in win.items() if isinstance(v, np.ndarray)]
        plan = [x for a, b in win["plan"] for x in (a if a is not None else b)]
        layout = {
            "arrays": [(k, v.dtype.str, v.shape) for k, v in named],
            "scalars": {k: v for k, v in win.items() if k != "plan" and not isinstance(v, np.ndarray)},
            "levels": len(win["plan"]),
            "plan_sizes": np.array([x.size for x in plan], np.int64),
        }
        offset = self._file.seek(0, 2)
        size = 0
        for values in [v for _, v in named] + [x.astype(np.int32, copy=False) for x in plan]:
            data = np.ascontiguousarray(values).tobytes()
            self._file.write(data + bytes(-len(data) % 8))
            size += len(data) + (-len(data) % 8)
        self._blocks.append((offset, size, layout))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if self._file is None:
            yield from self._held
            return
        for offset, size, layout in self._blocks:
            self._file.seek(offset)
            buffer = bytearray(size)
            self._file.readinto(buffer)
            win: dict[str, Any] = dict(layout["scalars"])
            at = 0
            for name, dtype, shape in layout["arrays"]:
                count = int(np.prod(shape, dtype=np.int64))
                win[name] = np.frombuffer(buffer, dtype, count, at).reshape(shape)
                at += -(-count * np.dtype(dtype).itemsize // 8) * 8
            plan = []
            for count in layout["plan_sizes"].tolist():
                plan.append(np.frombuffer(buffer, np.int32, count, at))
                at += -(-count * 4 // 8) * 8
            width = len(plan) // max(layout["levels"], 1)
            steps = [tuple(plan[i : i + width]) for i in range(0, len(plan), width)] if plan else []
            win["plan"] = [(None, lv) if win["fast"] else (lv, None) for lv in steps]
            yield win


def levels(win: dict[str, Any]) -> list[tuple[Any, Any]] | None:
    """Evaluation plan of a window's dependency graph, level by level; None when it has a cycle. Each level is
    (general plan, None) or, when ``win["fast"]`` (no host issue times), (None, fast plan): only the one the
    replay reads is kept.

    Per event: its arrival needs the completion of the previous operation on its rank (level of
    that batch + 1; an earlier window's event, a *ghost*, is done before the window starts); a group
    (collective, or a send with its receive) is ready once its members have arrived; a batch
    (operations posted together) completes once its groups are ready. Levels are found inside each
    step first (all steps at once: a step's chain is short), then the steps are laid end to end and
    the few constraints that cross a boundary (a rank's first operation after its previous step's
    last; a group whose members fell in two steps) are settled by relaxation.
    """
    prev, group, batch = win["prev"], win["group_dense"], win["batch"]
    n = prev.size
    n_groups, n_batches = int(group.max()) + 1, batch.size - n + int(win["n_own_batches"])
    own_batch = batch[:n]
    safe_prev = np.maximum(prev, 0)
    step = win["step"]
    ghost_prev = prev >= n
    inside = (prev >= 0) & ~ghost_prev & (step[safe_prev] == step[:n])
    step_index = np.unique(step[:n], return_inverse=True)[1]
    batch_step = np.zeros(n_batches, np.int64)
    batch_step[own_batch] = step_index
    ghost_level = np.zeros(n_batches, bool)
    ghost_level[int(win["n_own_batches"]) :] = True

    def settle(
        first: np.ndarray, lv_a: np.ndarray, lv_b: np.ndarray, rounds: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        for _ in range(rounds):
            lv_a = np.where(first, lv_a, np.maximum(lv_a, lv_b[batch[safe_prev]] + 1))
            lv_g = np.zeros(n_groups, np.int64)
            np.maximum.at(lv_g, group, lv_a)
            new = lv_b.copy()
            np.maximum.at(new, own_batch, lv_g[group])
            if np.array_equal(new, lv_b):
                return lv_a, lv_g, lv_b
            lv_b = new
        return None

    # Ghost batches sit at level -1: done before the window's first level.
    start_b = np.where(ghost_level, -1, 0).astype(np.int64)
    got = settle(~inside, np.zeros(n, np.int64), start_b, int(win["max_chain"]) + 16)
    if got is None:
        return None  # matching errors formed a cycle
    lv_a, _, lv_b = got
    span = np.zeros(int(step_index.max(initial=0)) + 1, np.int64)
    np.maximum.at(span, batch_step[~ghost_level], lv_b[~ghost_level] + 1)
    offset = np.r_[0, np.cumsum(span)[:-1]]
    lv_b = np.where(ghost_level, -1, lv_b + offset[batch_step])
    got = settle(prev < 0, lv_a + offset[step_index], lv_b, int(win["max_chain_all"]) + 16)
    if got is None:
        return None
    lv_a, lv_g, lv_b = got
    first = prev < 0
    n_levels = int(lv_b.max(initial=0)) + 1
    idx = np.arange(n)
    order_a = np.argsort(lv_a, kind="stable")
    cut_a = np.searchsorted(lv_a[order_a], np.arange(n_levels + 1))

    def segments(owner: np.ndarray, level_of_owner: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        order = np.lexsort((owner, level_of_owner[owner]))
        return order, np.searchsorted(level_of_owner[owner][order], np.arange(n_levels + 1))

    order_g, cut_g = segments(group, lv_g)
    order_b, cut_b = segments(own_batch, lv_b)
    # Events alone in their group and their batch (compute, local operations): their batch ends
    # at their arrival plus their work, with no reduction; the fast plan handles them apart.
    alone = (np.bincount(group, minlength=n_groups)[group] == 1) & (
        np.bincount(own_batch, minlength=n_batches)[own_batch] == 1
    )
    shifted = win["shift"] != 0
    plan = []
    for lv in range(n_levels):
        ia = order_a[cut_a[lv] : cut_a[lv + 1]]
        gm = order_g[cut_g[lv] : cut_g[lv + 1]]
        bm = order_b[cut_b[lv] : cut_b[lv + 1]]
        if not win["fast"]:
            # The general replay's plan (host issue times): per level, arrivals, then groups, then batches.
            g_seg = np.flatnonzero(np.r_[True, group[gm][1:] != group[gm][:-1]]) if gm.size else idx[:0]
            b_seg = np.flatnonzero(np.r_[True, own_batch[bm][1:] != own_batch[bm][:-1]]) if bm.size else idx[:0]
            plan.append((_compact((ia, gm, g_seg, group[gm][g_seg], bm, b_seg, own_batch[bm][b_seg])), None))
            continue
        # Fast plan: a rank's first operation starts from its observed start; any other arrival
        # follows the end of the previous operation's batch (moved into its step's frame when
        # that operation belongs to an earlier step).
        starts, follows = ia[first[ia]], ia[~first[ia]]
        moved = np.flatnonzero(shifted[follows])
        solo, gm2, bm2 = ia[alone[ia]], gm[~alone[gm]], bm[~alone[bm]]
        g2 = np.flatnonzero(np.r_[True, group[gm2][1:] != group[gm2][:-1]]) if gm2.size else idx[:0]
        b2 = np.flatnonzero(np.r_[True, own_batch[bm2][1:] != own_batch[bm2][:-1]]) if bm2.size else idx[:0]
        fast = (
            starts,
            follows,
            batch[safe_prev[follows]],
            moved,
            follows[moved],
            solo,
            own_batch[solo],
            gm2,
            g2,
            group[gm2][g2],
            bm2,
            b2,
            own_batch[bm2][b2],
        )
        plan.append((None, _compact(fast)))
    return plan


def _compact(indices: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """A level's index arrays as 32-bit integers (a window holds far fewer than 2**31 events): the plans of every
    window are kept between the culprit rounds' replays, and half as many bytes is half the memory they hold."""
    return tuple(x.astype(np.int32) for x in indices)


def replay_window(
    win: dict[str, Any],
    gap_t: np.ndarray,
    work_t: np.ndarray,
    start_t: np.ndarray,
    ghost_end: np.ndarray,
    ghost_cpu: np.ndarray,
) -> tuple[np.ndarray, np.ndarray | None]:
    """One window's replay on event-major inputs (events x scenarios) along its level plan: (ends, host issue
    times or None when the replay does not track them), event-major.

    ``start_t`` holds one row per event; only the rows of ranks' first operations are read. ``ghost_end`` and
    ``ghost_cpu`` (one row per ghost) carry the earlier windows' events this window follows.
    """
    prev, group, batch = win["prev"], win["group_dense"], win["batch"]
    first, safe_prev = prev < 0, np.maximum(prev, 0)
    sync, launch = win["sync"], win["launch"]
    n, c = gap_t.shape
    nb = int(win["n_own_batches"])
    shift_col = win["shift"].astype(gap_t.dtype)[:, None]
    ready = np.zeros((int(group.max(initial=0)) + 1, c), dtype=gap_t.dtype)
    b_end = np.zeros((batch.size - n + nb, c), dtype=gap_t.dtype)
    b_end[nb:] = ghost_end
    arrive = np.zeros((n, c), dtype=gap_t.dtype)
    if win["fast"]:
        # Without host issue times every operation is issued when the previous one on its rank
        # ends: the arrival is that end (a rank's first: its start) plus the gap.
        for _, fast in win["plan"]:
            starts, follows, prev_batch, moved, moved_ev, solo, solo_batch, gm, g_seg, g_ids, bm, b_seg, b_ids = fast
            if starts.size:
                arrive[starts] = start_t[starts] + gap_t[starts]
            if follows.size:
                at = b_end[prev_batch] + gap_t[follows]
                if moved.size:
                    at[moved] += shift_col[moved_ev]
                arrive[follows] = at
            if solo.size:
                b_end[solo_batch] = arrive[solo] + work_t[solo]
            if gm.size:
                ready[g_ids] = np.maximum.reduceat(arrive[gm], g_seg, axis=0)
            if bm.size:
                b_end[b_ids] = np.maximum.reduceat(ready[group[bm]] + work_t[bm], b_seg, axis=0)
        return b_end[batch[:n]], None
    cpu = np.zeros((batch.size, c), dtype=gap_t.dtype)
    cpu[n:] = ghost_cpu
    sync_col, first_col, launch_col = sync[:, None], first[:, None], launch[:, None]
    for (ia, gm, g_seg, g_ids, bm, b_seg, b_ids), _ in win["plan"]:
        if ia.size:
            p, f, sh = safe_prev[ia], first_col[ia], shift_col[ia]
            e_prev = b_end[batch[p]] + sh
            base = np.where(f, start_t[ia], np.where(sync_col[ia], e_prev, cpu[p] + sh))
            q = base + gap_t[ia]
            cpu[ia] = q
            arrive[ia] = np.maximum(q, np.where(f, -np.inf, e_prev)) + launch_col[ia]
        if gm.size:
            ready[g_ids] = np.maximum.reduceat(arrive[gm], g_seg, axis=0)
        if bm.size:
            b_end[b_ids] = np.maximum.reduceat(ready[group[bm]] + work_t[bm], b_seg, axis=0)
    return b_end[batch[:n]], cpu[:n]


Inputs = Callable[[dict[str, Any]], tuple[np.ndarray, np.ndarray, np.ndarray]]


def _advance(
    win: dict[str, Any], carry: tuple[np.ndarray, np.ndarray], inputs: tuple[np.ndarray, np.ndarray, np.ndarray]
) -> np.ndarray:
    """One window's replay (``replay_window``) from the carry (per rank slot: the end and host issue time of its
    last operation so far, per scenario), which it then moves past the window: its events' ends, event-major."""
    carry_end, carry_cpu = carry
    slots = win["ghost_slots"]
    end, cpu = replay_window(win, *inputs, carry_end[slots], carry_cpu[slots])
    carry_end[win["export_slots"]] = end[win["exports"]]
    if cpu is not None:
        carry_cpu[win["export_slots"]] = cpu[win["exports"]]
    return end


def _carry(arrays: dict[str, Any], scenarios: int, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros((arrays["carried"], scenarios), dtype), np.zeros((arrays["carried"], scenarios), dtype)


def replay_windows(
    arrays: dict[str, Any], inputs: Inputs, scenarios: int, dtype: Any
) -> Iterator[tuple[dict, np.ndarray]]:
    """(window, its events' ends, event-major) for every window in order; ``inputs(window)`` gives the window's
    event-major (gap, work, start). Only the carry (each rank's last operation so far) passes between windows."""
    carry = _carry(arrays, scenarios, dtype)
    for win in arrays["plan"]:
        yield win, _advance(win, carry, inputs(win))


def replay(arrays: dict[str, Any], gap: np.ndarray, work: np.ndarray, start: np.ndarray) -> np.ndarray:
    """End time of every event in each scenario (rows of ``gap``, ``work``, ``start``), all steps.

    Times are relative to each event's step frame (its step's begin); ``start`` is read only for
    a rank's first operation. The host issues an operation a gap after issuing the previous one,
    or after the previous one completed when it waited for it; the device starts it once issued
    (plus the launch delay) and once the previous operation on the rank has ended; a group
    completes its last member's arrival plus its transfer; a batch completes with its slowest
    member. Max-plus: shorter durations never give a later end.
    """
    c = gap.shape[0]
    if arrays["plan"] is None:
        prev, group, batch = arrays["prev"], arrays["group_dense"], arrays["batch"]
        first, safe_prev = prev < 0, np.maximum(prev, 0)
        sync, launch, shift = arrays["sync"], arrays["launch"], arrays["shift"]
        # A cycle (matching errors): iterate from below, a bounded number of passes.
        end = start.copy()
        cpu = start.copy()
        for _ in range(int(arrays["max_chain_all"]) + 16):
            e_prev = end[:, safe_prev] + shift
            base = np.where(first, start, np.where(sync, e_prev, cpu[:, safe_prev] + shift))
            new_cpu = base + gap
            arrive = np.maximum(new_cpu, np.where(first, -np.inf, e_prev)) + launch
            ready = np.full((c, int(group.max()) + 1), -np.inf)
            for i in range(c):
                np.maximum.at(ready[i], group, arrive[i])
            own = ready[:, group] + work
            b_end = np.full((c, int(batch.max()) + 1), -np.inf)
            for i in range(c):
                np.maximum.at(b_end[i], batch, own[i])
            new_end = b_end[:, batch]
            if np.array_equal(new_end, end) and np.array_equal(new_cpu, cpu):
                break
            end, cpu = new_end, new_cpu
        return end
    # Event-major layout: gathering an event's values over all scenarios reads one contiguous row.
    gap_t, work_t, start_t = (np.ascontiguousarray(x.T) for x in (gap, work, start))
    out = np.zeros_like(gap_t)

    def window_inputs(win: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ev = win["events"]
        return gap_t[ev], work_t[ev], start_t[ev]

    for win, end in replay_windows(arrays, window_inputs, c, gap_t.dtype):
        out[win["events"]] = end
    return np.ascontiguousarray(out.T)


def step_times(arrays: dict[str, Any], end: np.ndarray) -> np.ndarray:
    """Per scenario (rows) and step (columns): step time, from ends relative to each step's frame.

    A step's time is the time from the previous step's last end to its own last end (the job's
    iteration time; summed over steps, the time from the first start to the last end); the first
    step's runs from its first start. Overlapping steps (a pipeline's first stage starts the next
    step while the last drains) are not counted twice.
    """
    end2 = np.atleast_2d(end)
    order, cuts = arrays["step_order"], arrays["step_cuts"]
    hi = np.maximum.reduceat(end2[:, order], cuts, axis=1)
    out = iteration_times(arrays, hi)
    return out if end.ndim == 2 else out[0]


def iteration_times(arrays: dict[str, Any], hi: np.ndarray) -> np.ndarray:
    """Per scenario and step: step time from the step's last end relative to its frame (see step_times)."""
    out = hi.copy()
    out[:, 1:] = np.maximum(hi[:, 1:] - hi[:, :-1] + np.diff(arrays["step_begin"])[None, :], 0.0)
    return out


def _masks(part: list[Any], atom: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Event-major (events x scenarios) masks of ``part``'s kept durations and gaps over the events whose atoms are
    ``atom``: a scenario's masks are per atom, expanded to the events here, window by window."""
    return np.stack([s.work for s in part], axis=1)[atom], np.stack([s.gap for s in part], axis=1)[atom]


def _window_times(arrays: dict[str, Any], chunks: list[Any], inputs: Callable, dtype: Any) -> np.ndarray:
    """Per scenario and step: replayed step time, the windows read once each (one at a time from the store), every
    chunk of scenarios replayed over a window before the next (each chunk with its own carry);
    ``inputs(window, chunk)`` gives the chunk's event-major (gap, work, start) over the window."""
    n_steps = arrays["step_begin"].size
    carries = [_carry(arrays, size, dtype) for _, size in chunks]
    his = [np.zeros((n_steps, size)) for _, size in chunks]
    for win in arrays["plan"]:
        a, _ = win["steps"]
        for (chunk, _), carry, hi in zip(chunks, carries, his, strict=True):
            end = _advance(win, carry, inputs(win, chunk))
            if end.shape[0]:
                local = np.maximum.reduceat(end[win["step_order"]], win["step_cuts"], axis=0)
                hi[a : a + local.shape[0]] = local
    out = [iteration_times(arrays, hi.T) for hi in his]
    return np.concatenate(out) if out else np.zeros((0, n_steps))


def column_times(arrays: dict[str, Any], gap: str, work: str, start: str) -> np.ndarray:
    """Step times (one scenario) of the replay with the per-event columns named ``gap``, ``work`` and ``start`` (held
    by the windows, ``step_windows``' ``columns``; by ``arrays`` for the whole-trace fallback), in float64."""
    if arrays["plan"] is None:
        return step_times(arrays, replay(arrays, arrays[gap][None], arrays[work][None], arrays[start][None]))[0]

    def inputs(win: dict[str, Any], _: object) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return win[gap][:, None], win[work][:, None], win[start][:, None]

    return _window_times(arrays, [(None, 1)], inputs, np.float64)[0]


def run(arrays: dict[str, Any], scenarios: list[Any]) -> np.ndarray:
    """Per scenario and step: replayed step time. A scenario has ``work`` and ``gap``, per atom
    (``arrays["atom"]``, or each window's ``atom``): whether its events keep their observed duration and gap (else
    their healthy one, ``ideal_work`` / ``ideal_gap``).

    Scenarios go through the replay in chunks of up to ``CHUNK_SCENARIOS``, window by window, so that a
    chunk's event x scenario arrays stay within ``WINDOW_BUDGET`` bytes whatever the trace's length (a
    window of one step larger than that takes fewer scenarios at a time, 4 at least). Along
    the level plan the times are float32 and relative to each step's begin (a step spans seconds at most:
    0.1 us resolution), which halves the memory traffic of the replay; the fallback stays float64.
    """
    out = []
    n_steps = arrays["step_begin"].size
    if arrays["plan"] is None:
        n = arrays["prev"].size
        order, cuts = arrays["step_order"], arrays["step_cuts"]
        chunk = int(np.clip(REPLAY_BUDGET // max(n * 4 * 8, 1), 4, CHUNK_SCENARIOS))
        for i in range(0, len(scenarios), chunk):
            part = scenarios[i : i + chunk]
            mw, mg = _masks(part, arrays["atom"])
            work = np.where(mw, arrays["work"][:, None], arrays["ideal_work"][:, None])
            gap = np.where(mg, arrays["gap"][:, None], arrays["ideal_gap"][:, None])
            start = np.broadcast_to(arrays["start_offset"][:, None], gap.shape)
            end = replay(arrays, gap.T, work.T, start.T).T
            hi = np.maximum.reduceat(end[order], cuts, axis=0)
            out.append(iteration_times(arrays, hi.T.astype(np.float64)))
        return np.concatenate(out) if out else np.zeros((0, n_steps))
    largest = max(arrays["plan"].sizes, default=1)
    size = int(np.clip(WINDOW_BUDGET // max(largest * 4 * 8, 1), 4, CHUNK_SCENARIOS))
    chunks = [(scenarios[i : i + size], len(scenarios[i : i + size])) for i in range(0, len(scenarios), size)]

    def inputs(win: dict[str, Any], part: list[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        # Built event-major (events x scenarios), the layout the replay reads.
        mw, mg = _masks(part, win["atom"])
        work = np.where(mw, win["work32"][:, None], win["ideal_work32"][:, None])
        gap = np.where(mg, win["gap32"][:, None], win["ideal_gap32"][:, None])
        # Only the ranks' first events read their start.
        start = np.empty_like(gap)
        first = win["prev"] < 0
        start[first] = win["start_offset32"][first, None]
        return gap, work, start

    return _window_times(arrays, chunks, inputs, np.float32)
