"""Period detection on a signature sequence: the fallback when no template fits.

Training repeats the same communication every step, so a rank's signature sequence x is
periodic. The period P is the smallest lag whose match rate ``mean(x[i] == x[i + P])`` is
within ``tolerance`` of the best lag's (multiples of the period match as well), provided it
reaches ``min_match``. The anchor (the operation that opens a step) is a signature, or a pair
(previous signature, signature), that occurs once per period; among those, the one preceded by
the longest median idle gap, because steps are separated by the optimizer, data loading and the
forward pass, where little communication runs; but when the rank reduces gradients over a
data-parallel communicator a few times per period, the anchor is the operation that follows that
reduction (and the tiny collectives after it), whatever the gaps: in a pipeline, bubbles and
backward compute are longer idle stretches than the optimizer. Pairs matter when the opening operation also
occurs elsewhere in the step (DDP's equal-sized gradient buckets); a pair counts only when the
engine, which sees no adjacency (the previous operation closes, the anchor opens, others are
neutral), would open one step per period with it: a pair side by side once a period may also
occur apart, with other operations between, and would open a second step there. When neither exists (ZeRO-3 /
FSDP: an all-gather per layer in forward, an all-gather and a reduce-scatter per layer in
backward), the anchor is an operation whose one long run per step opens it (``_run_anchor``).

Programs change from step to step: message sizes follow a variable sequence length or an MoE
router, a checkpoint or a loss-scale collective comes every few steps, the gradient accumulation
count varies. When the exact signatures repeat worse than coarse ones (``coarse_signatures``: the size
read only as unknown, tiny or large) by more than the tolerance, the period is the coarse one. When the rank reduces
gradients over a data-parallel communicator, a step is what lies between two such reductions (one
optimizer update each): a period holding several reductions whose stretches are the same program
but for an occasional operation (a checkpoint every third step) is cut at each of them, and a
sequence without any period (micro-batches varying) is cut there when the stretches between
reductions hold the same operations (``_gradient_sync_steps``).

Short real traces carry one-off collectives before the first regular step (a framework's set-up:
parameter broadcasts, shape checks, the first iteration's different bucketing) and after the last
(a closing barrier); a few of them are enough to pull every lag's rate under ``min_match``. Then
each lag is measured over the stretch between its first and last match instead, when that stretch
covers at least ``min_cover`` of the trace and three periods; events before the stretch are set-up
(``Period.setup``) and belong to no step.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from comminsight.semantic.roles import OP_CODE, ROLE_CODE

_DP = ROLE_CODE["dp"]
_REDUCTIONS = (OP_CODE["reduce_scatter"], OP_CODE["all_reduce"])
_TINY_BUCKET = 12  # at most 4 KiB: a loss, a grad norm, a flag
# Of the operations between two gradient reductions, the share that must belong to the program every
# such stretch runs (the rest: occasional operations, a checkpoint's barrier, a loss-scale flag).
_CORE_SHARE = 0.9


def coarse_signatures(sig: np.ndarray) -> np.ndarray:
    """Signatures with the size read only as unknown (bucket 0), tiny (1: at most 4 KiB) or large (2).

    Still valid signatures (indices of the engine's class tables). Sizes that follow the data (a
    sequence length, an MoE router) change the exact bucket from step to step; tiny control messages
    (a loss, a flag) stay apart from data."""
    s = np.asarray(sig, dtype=np.int64)
    bucket = s % 64
    return s - bucket + np.where(bucket == 0, 0, np.where(bucket <= _TINY_BUCKET, 1, 2))


def _after_gradient_sync(sig: np.ndarray, period: int | None) -> np.ndarray:
    """Positions of the first operation after each data-parallel gradient reduction, or none.

    In a model-parallel step the data-parallel gradient reduction (all-reduce or reduce-scatter
    on the data-parallel communicator) is the last thing of the step; the optimizer follows,
    then the next step opens with whatever comes next (a parameter all-gather, a pipeline
    receive). Tiny collectives right after the reduction (grad norm, loss) still belong to the
    step that ends. Idle gaps are no guide there: pipeline bubbles and backward compute are
    longer than the optimizer. None when the sequence has no data-parallel reduction, or has
    more than a few per period (DDP-style buckets inside backward; ``period`` None: no bound).
    """
    s = sig.astype(np.int64)
    role, op, bucket = s // (64 * 16), (s // 64) % 16, s % 64
    reduce = (role == _DP) & np.isin(op, _REDUCTIONS) & ((bucket == 0) | (bucket > _TINY_BUCKET))
    tiny = (bucket > 0) & (bucket <= _TINY_BUCKET)
    if not reduce.any() or (period is not None and reduce.sum() > 4 * max(len(s) // period, 1)):
        return np.zeros(0, np.int64)
    ends = np.flatnonzero(reduce[:-1] & ~reduce[1:]) + 1
    out = []
    for q in ends:  # a handful per period
        while q < len(s) and tiny[q] and not reduce[q]:
            q += 1
        if q < len(s):
            out.append(q)
    return np.asarray(out, np.int64)


@dataclass(frozen=True)
class Period:
    period: int  # operations per step
    anchor: int  # signature that opens each step
    anchor_prev: int  # signature just before it (-1: the anchor alone is unique per period)
    match: float  # match rate at the period lag
    setup: int = 0  # leading events that precede the periodic stretch (set-up, before step 0)
    min_run: int = 1  # anchors in a row needed to open a step (a run anchor: see _run_anchor)
    coarse: bool = False  # anchor and anchor_prev are coarse signatures (``coarse_signatures``): any size of theirs


def detect_period(
    sig: np.ndarray,
    start_ns: np.ndarray,
    end_ns: np.ndarray,
    max_period: int = 2048,
    min_match: float = 0.8,
    tolerance: float = 0.02,
    min_cover: float = 0.5,
) -> Period | None:
    """Period and anchor of one rank's signature sequence, or None when it has no steps (module doc).

    Exact signatures first; coarse ones when they repeat better (by more than ``tolerance``). A period
    holding several gradient reductions that cut it into the same program is cut at each; without a
    period, the stretches between gradient reductions are the steps when they hold the same operations.
    """
    sig = np.asarray(sig, dtype=np.int64)
    args = (start_ns, end_ns, max_period, min_match, tolerance, min_cover)
    found = _detect(sig, sig, *args)
    if found is None or found.match < 1 - tolerance:
        # Sizes that vary from step to step: the coarse program repeats better than the exact one.
        coarse = _detect(sig, coarse_signatures(sig), *args)
        if coarse is not None and (found is None or coarse.match > found.match + tolerance):
            found = Period(**{**coarse.__dict__, "coarse": True})
    return _gradient_sync_steps(sig, found, tolerance)


def _detect(
    sig: np.ndarray,
    key: np.ndarray,
    start_ns: np.ndarray,
    end_ns: np.ndarray,
    max_period: int,
    min_match: float,
    tolerance: float,
    min_cover: float,
) -> Period | None:
    """``detect_period`` on ``key`` (the signatures, or coarse ones); ``sig`` the exact ones.

    The sequence is read as runs of identical operations (a signature and how many times it
    repeats back to back): a step of many identical operations (hundreds of gradient buckets,
    the tensor-parallel all-reduces of every layer) is then a handful of runs. Rated per event,
    such a step matched itself at lag 1 almost everywhere (all but the few changes of signature
    per step), so the smallest lag within ``tolerance`` of the best was 1 and no step was found
    once a step held about 150 identical operations. ``max_period`` counts runs.
    """
    n_events = len(sig)
    if n_events < 2:
        return None
    run_at = np.flatnonzero(np.concatenate(([True], key[1:] != key[:-1])))  # first event of each run
    run_len = np.diff(np.concatenate((run_at, [n_events])))
    run_sig = key[run_at]
    # A run is its signature and its length; both must repeat for the program to repeat.
    token = run_sig * (np.int64(run_len.max()) + 1) + run_len
    n = len(token)
    limit = min(max_period, n // 2)
    if limit < 1:
        return None
    rates = np.zeros(limit + 1)
    # Per lag: first and last position where the sequence matches itself (the periodic stretch).
    first = np.zeros(limit + 1, np.int64)
    last = np.full(limit + 1, -1, np.int64)
    for lag in range(1, limit + 1):  # one vectorised comparison per lag, not per run
        hit = np.flatnonzero(token[:-lag] == token[lag:])
        rates[lag] = hit.size / (n - lag)
        if hit.size:
            first[lag], last[lag] = hit[0], hit[-1]
    lo, hi = 0, n
    top_rate = rates.max()
    if top_rate >= min_match:
        period = int(np.flatnonzero(rates >= top_rate - tolerance)[0])
        match = float(rates[period])
    else:
        # Set-up and tear-down dilute the rate of a short trace: rate each lag over its stretch.
        lags = np.arange(limit + 1)
        span = last - first + 1
        ok = (last >= 0) & (lags > 0) & (span + lags >= min_cover * n) & (span >= 2 * lags)
        trimmed = np.where(ok, rates * (n - lags) / np.maximum(span, 1), 0.0)
        top_rate = trimmed.max()
        if top_rate < min_match:
            return None
        period = int(np.flatnonzero(trimmed >= top_rate - tolerance)[0])
        match = float(trimmed[period])
        lo, hi = int(first[period]), min(int(last[period]) + period + 1, n)
    at = run_at[lo:hi]  # event position of each run of the stretch
    ev_lo, ev_hi = int(at[0]), int(run_at[hi]) if hi < n else n_events
    expected = (hi - lo) / period  # steps in the stretch
    events_per_step = max(1, round((ev_hi - ev_lo) / expected))
    # Idle time before each run's first event.
    gap = np.zeros(hi - lo, dtype=np.float64)
    inner = at > 0
    gap[inner] = start_ns[at[inner]] - end_ns[at[inner] - 1]
    if lo == 0:
        gap[0] = 0.0
    rs = run_sig[lo:hi]
    base = np.int64(rs.max()) + 1
    pairs = rs[:-1] * base + rs[1:]
    after = _after_gradient_sync(sig[ev_lo:ev_hi], events_per_step) + ev_lo
    best: tuple[float, int, int] | None = None
    # Candidates: a signature that forms one run per step, or a (previous run, run) pair that occurs once per step.
    for values, is_pair in ((rs, False), (pairs, True)):
        codes, counts = np.unique(values, return_counts=True)
        for code in codes[np.abs(counts - expected) <= 1 + 0.05 * expected]:  # a handful of candidates
            where = np.flatnonzero(values == code) + (1 if is_pair else 0)
            g = float(np.median(gap[where]))
            # An opening found after the data-parallel gradient synchronisation outranks any gap.
            g += float(np.isin(at[where], after).mean()) * 1e30 if after.size else 0.0
            anchor, prev = (int(code % base), int(code // base)) if is_pair else (int(code), -1)
            if is_pair and abs(_pair_opens(key[ev_lo:ev_hi], anchor, prev) - expected) > 1 + 0.05 * expected:
                continue  # side by side once a period, but apart as well: the engine would open more steps
            if best is None or g > best[0] + 1e-9:
                best = (g, anchor, prev)
    if best is None:
        run = _run_anchor(key[ev_lo:ev_hi], expected)
        if run is None:
            return None
        return Period(events_per_step, anchor=run[0], anchor_prev=run[1], match=match, setup=ev_lo, min_run=run[2])
    return Period(period=events_per_step, anchor=best[1], anchor_prev=best[2], match=match, setup=ev_lo)


def _pair_opens(key: np.ndarray, anchor: int, prev: int) -> int:
    """Steps a pair anchor opens in ``key`` under the engine's classes: ``prev`` closes, ``anchor`` opens, others
    are neutral, so the anchor opens a step after ``prev`` whatever lies between them."""
    seen = key[(key == anchor) | (key == prev)]
    is_anchor = seen == anchor
    return int(np.count_nonzero(is_anchor[1:] & ~is_anchor[:-1]))


def _run_anchor(sig: np.ndarray, expected: float) -> tuple[int, int, int] | None:
    """(anchor, anchor_prev, min_run) when a step opens with the one long run of an operation, or None.

    ZeRO-3 / FSDP: a step is an all-gather before each layer's forward, then per layer in backward an
    all-gather and a reduce-scatter. No operation and no pair of neighbours occurs once per step, but
    the forward's all-gathers form, after the last reduce-scatter, the one long run of all-gathers
    of the step. Read with ``anchor_prev`` closing a step, ``anchor`` opening one and every other
    operation neutral (the engine's classes), the anchor's runs after an ``anchor_prev`` are counted;
    if about one per step is longer than all the others, a step opens at the first anchor of a run of
    at least ``min_run`` (one more than the longest of the others).
    """
    codes, counts = np.unique(sig, return_counts=True)
    best: tuple[int, int, int, float] | None = None
    tol = 1 + 0.05 * expected
    for a in codes[counts >= 2 * expected - tol]:  # a handful: operations at least twice a step
        for p in codes[(codes != a) & (counts >= expected - tol)]:
            seq = sig[(sig == a) | (sig == p)]  # the engine's view: others neutral
            is_a = seq == a
            begin = np.flatnonzero(is_a & np.concatenate(([True], ~is_a[:-1])))
            after_p = begin > 0  # a run at the very start has no closing operation before it
            ends = np.concatenate((np.flatnonzero(~is_a), [seq.size]))
            length = ends[np.searchsorted(ends, begin)] - begin
            length = length[after_p]
            if length.size < expected - tol:
                continue
            order = np.sort(length)[::-1]
            # The long runs: the top j, about one per step (the first step's may open the stretch).
            for j in range(max(1, int(np.ceil(expected - tol))), min(order.size - 1, int(expected + tol)) + 1):
                margin = float(order[j - 1] - order[j])  # how clearly the long runs stand out
                if margin > 0 and (best is None or margin > best[3]):
                    best = (int(a), int(p), int(order[j]) + 1, margin)
    return None if best is None else best[:3]


def _gradient_sync_steps(sig: np.ndarray, found: Period | None, tolerance: float) -> Period | None:
    """Steps cut at the data-parallel gradient reductions, when they are the job's steps; else ``found``.

    A step is one optimizer update: one gradient reduction over the data-parallel communicator (a
    run of them: buckets). The stretches between consecutive reductions (from the operation after
    one, tiny collectives skipped, to the next) are steps when they run the same program: every
    operation (coarse signature) present in at least half of them is present in each, and those
    make at least ``_CORE_SHARE`` of their operations. With a period that repeats exactly (its match
    within ``tolerance`` of 1), it is cut only when it holds several stretches that are the same
    sequence of runs once the occasional operations are left out (a checkpoint every third step made
    the period three steps; HSDP's per-layer reductions cut a step into stretches that are not the
    same); without a period, or with one that repeats only in part (the number of micro-batches
    varies, so runs repeat differently: the last stage of DP8xPP8 found a period of two steps at
    0.84), the stretches are the steps.
    """
    after = _after_gradient_sync(sig, None)
    if found is not None and found.period > 0:
        per_period = after.size * found.period / max(len(sig) - found.setup, 1)
        if 0.5 <= per_period < 1.5:
            return found  # one reduction a period: the period is the step
        # Several reductions a period, or a period without one (a micro-batch: every step holds an update).
    if after.size < 3:
        return found
    key = coarse_signatures(sig)
    inner = [key[a:b] for a, b in pairwise(after)]  # whole stretches
    core = _core(inner)
    if core is None or not all(np.isin(core, piece).all() for piece in inner):
        return found
    if found is not None and found.match >= 1 - tolerance:
        # The same program, run for run, once the occasional operations are left out.
        runs = set()
        for piece in inner:
            kept = piece[np.isin(piece, core)]
            at = np.flatnonzero(np.concatenate(([True], kept[1:] != kept[:-1])))
            runs.add((kept[at].tobytes(), np.diff(np.concatenate((at, [kept.size]))).tobytes()))
        if len(runs) > 1:
            return found
    opener, n_open = np.unique(key[after], return_counts=True)
    closer, n_close = np.unique(key[after - 1 - _tiny_run_before(sig, after)], return_counts=True)
    anchor, anchor_prev = int(opener[np.argmax(n_open)]), int(closer[np.argmax(n_close)])
    if anchor == anchor_prev:
        return found
    length = int(np.median(np.diff(after)))
    return Period(period=length, anchor=anchor, anchor_prev=anchor_prev, match=1.0, coarse=True)


def _core(pieces: list[np.ndarray]) -> np.ndarray | None:
    """The coarse operations present in at least half of ``pieces`` (coarse signatures), or None when they make
    less than ``_CORE_SHARE`` of the pieces' operations (the pieces do not run one program)."""
    present = [np.unique(piece) for piece in pieces]
    codes, counts = np.unique(np.concatenate(present), return_counts=True)
    core = codes[2 * counts >= len(pieces)]
    in_core = sum(int(np.isin(piece, core).sum()) for piece in pieces)
    return core if in_core >= _CORE_SHARE * sum(piece.size for piece in pieces) else None


def same_program_share(sig: np.ndarray, starts: np.ndarray) -> float:
    """Share of the whole steps between ``starts`` (positions in ``sig``) that run the job's program: hold every
    coarse operation present in at least half of them, those making ``_CORE_SHARE`` of their operations (0 when
    they do not). A step's length changes with its micro-batch count; its operations do not."""
    if starts.size < 3:
        return 0.0
    key = coarse_signatures(sig)
    pieces = [key[a:b] for a, b in pairwise(starts)]
    core = _core(pieces)
    if core is None:
        return 0.0
    return sum(bool(np.isin(core, piece).all()) for piece in pieces) / len(pieces)


def _tiny_run_before(sig: np.ndarray, after: np.ndarray) -> np.ndarray:
    """How many tiny collectives lie between each reduction and the operation at ``after``."""
    bucket = np.asarray(sig, dtype=np.int64) % 64
    tiny = (bucket > 0) & (bucket <= _TINY_BUCKET)
    out = np.zeros(after.size, np.int64)
    for i, q in enumerate(after):  # a handful per step
        while q - 1 - out[i] > 0 and tiny[q - 1 - out[i]]:
            out[i] += 1
    return out
