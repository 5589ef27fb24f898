"""Exact quantiles per key of values spread over parts (windows of steps, partitions), by counting passes.

A quantile over every part is not a sum of the parts' quantiles, and holding every value at once is what
a bounded analysis must not do. So the parts are read several times, each read keeping per-key counts only:

1. per key: the number of values (NaN skipped), the smallest and the largest;
2. the ranks wanted (polars' linear quantile reads the values at positions floor and ceil of q x (n - 1) of
   the sorted values): per wanted rank an interval [low, high] known to hold it, and how many values lie
   below it. A pass cuts each interval holding more than ``COLLECT`` values into ``BINS`` bins by comparison
   with edges (no rounding decides a value's bin), counts the values per bin and keeps the bin holding the
   rank; repeated until every interval holds at most ``COLLECT`` values or a single value;
3. a last pass collects the values of each interval, sorts them and reads the rank; the quantile is then
   polars' ``quantile(q, "linear")`` of those two values, to the bit.

Memory: per key and wanted rank a few numbers and, in the last pass, at most ``COLLECT`` values; never the
values of every part. Passes: 2 plus one per refinement (a key with n values in one interval needs about
log_BINS(n / COLLECT) of them; equal values end the refinement at once).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np

BINS = 256
COLLECT = 1024

Parts = Callable[[], Iterable[tuple[np.ndarray, np.ndarray]]]


def keyed_quantiles(parts: Parts, n_keys: int, qs: Sequence[float]) -> np.ndarray:
    """Per key (rows, ids 0..n_keys-1) and quantile (columns): polars' linear quantile of the key's values over
    every part (NaN for a key without values). ``parts()`` yields (keys, values) arrays and is called once per pass.
    """
    count = np.zeros(n_keys, np.int64)
    low = np.full(n_keys, np.inf)
    high = np.full(n_keys, -np.inf)
    for key, values in _valid(parts):
        count += np.bincount(key, minlength=n_keys)
        np.minimum.at(low, key, values)
        np.maximum.at(high, key, values)
    # The wanted ranks: per key, floor and ceil of q x (n - 1) for each q (slots: 2 per q).
    where = np.array([(np.maximum(count, 1) - 1) * q for q in qs]).T  # n_keys x len(qs)
    ranks = np.concatenate([np.floor(where), np.ceil(where)], axis=1).astype(np.int64)
    slots = ranks.shape[1]
    lo = np.repeat(low[:, None], slots, axis=1)  # interval [lo, hi] holding the rank
    hi = np.repeat(high[:, None], slots, axis=1)
    below = np.zeros((n_keys, slots), np.int64)  # values under lo
    inside = np.repeat(count[:, None], slots, axis=1)  # values in [lo, hi]
    has = count > 0
    settled = np.zeros((n_keys, slots), bool)  # an interval no bin can narrow (adjacent floats)
    while True:
        refine = has[:, None] & (inside > COLLECT) & (lo < hi) & ~settled
        if not refine.any():
            break
        # Edges per interval: BINS bins, the last closed at hi; a value's bin by comparison with the edges.
        steps = np.linspace(0.0, 1.0, BINS + 1)
        edges = lo[..., None] + (hi - lo)[..., None] * steps  # n_keys x slots x (BINS + 1)
        edges[..., -1] = hi
        edges = np.maximum.accumulate(edges, axis=-1)
        counts = np.zeros((n_keys, slots, BINS), np.int64)
        for key, values in _valid(parts):
            for s in np.flatnonzero(refine.any(axis=0)):
                pick = refine[key, s] & (values >= lo[key, s]) & (values <= hi[key, s])
                k, v = key[pick], values[pick]
                np.add.at(counts, (k, s, _bin(edges[:, s], k, v)), 1)
        cum = np.cumsum(counts, axis=-1)
        for k, s in zip(*np.nonzero(refine), strict=True):
            target = ranks[k, s] - below[k, s]
            b = int(np.searchsorted(cum[k, s], target, side="right"))
            before = int(cum[k, s, b - 1]) if b else 0
            below[k, s] += before
            inside[k, s] = int(counts[k, s, b])
            new_lo = edges[k, s, b]
            new_hi = hi[k, s] if b == BINS - 1 else np.nextafter(edges[k, s, b + 1], -np.inf)
            new_hi = max(new_lo, new_hi)
            settled[k, s] = new_lo == lo[k, s] and new_hi == hi[k, s]
            lo[k, s], hi[k, s] = new_lo, new_hi
    # Last pass: each interval's values, sorted; the rank read from them.
    found: list[list[np.ndarray]] = [[] for _ in range(slots)]
    owners: list[list[np.ndarray]] = [[] for _ in range(slots)]
    for key, values in _valid(parts):
        for s in range(slots):
            pick = (values >= lo[key, s]) & (values <= hi[key, s])
            found[s].append(values[pick])
            owners[s].append(key[pick])
    value_at = np.full((n_keys, slots), np.nan)
    for s in range(slots):
        v = np.concatenate(found[s]) if found[s] else np.zeros(0)
        k = np.concatenate(owners[s]) if owners[s] else np.zeros(0, np.int64)
        order = np.lexsort((v, k))
        v, k = v[order], k[order]
        start = np.searchsorted(k, np.arange(n_keys))
        pos = start + ranks[:, s] - below[:, s]
        ok = has & (pos < np.r_[start[1:], k.size])
        value_at[ok, s] = v[pos[ok]]
    out = np.full((n_keys, len(qs)), np.nan)
    for i in range(len(qs)):
        a, b = value_at[:, i], value_at[:, len(qs) + i]
        proportion = where[:, i] - np.floor(where[:, i])
        # polars: the value at the floor, or proportion x (ceil's - floor's) + floor's.
        out[:, i] = np.where(ranks[:, i] == ranks[:, len(qs) + i], a, proportion * (b - a) + a)
    out[~has] = np.nan
    return out


def _bin(edges: np.ndarray, key: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per value, the bin j of its key's edges with edges[j] <= value < edges[j + 1] (the last bin closed): a
    guess by arithmetic, settled by comparisons with the edges themselves."""
    first, last = edges[key, 0], edges[key, -1]
    span = np.where(last > first, last - first, 1.0)
    b = np.clip(np.floor((values - first) / span * BINS), 0, BINS - 1).astype(np.int64)
    while True:
        down = (b > 0) & (values < edges[key, b])
        up = (b < BINS - 1) & (values >= edges[key, b + 1])
        if not (down.any() or up.any()):
            return b
        b = b - down + up


def _valid(parts: Parts) -> Iterable[tuple[np.ndarray, np.ndarray]]:
    for key, values in parts():
        ok = ~np.isnan(values)
        yield key[ok], values[ok]
