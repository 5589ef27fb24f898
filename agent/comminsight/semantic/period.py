"""Period detection on a signature sequence: the fallback when no template fits.

Training repeats the same communication every step, so a rank's signature sequence x is
periodic. The period P is the smallest lag whose match rate ``mean(x[i] == x[i + P])`` is
within ``tolerance`` of the best lag's (multiples of the period match as well), provided it
reaches ``min_match``. The anchor (the operation that opens a step) is a signature that occurs
once per period; among those, the one preceded by the longest median idle gap, because steps
are separated by the optimizer and data loading, where no communication runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Period:
    period: int  # operations per step
    anchor: int  # signature that opens each step
    match: float  # match rate at the period lag


def detect_period(
    sig: np.ndarray,
    start_ns: np.ndarray,
    end_ns: np.ndarray,
    max_period: int = 2048,
    min_match: float = 0.8,
    tolerance: float = 0.02,
) -> Period | None:
    """Period and anchor of one rank's signature sequence, or None when it is not periodic."""
    n = len(sig)
    limit = min(max_period, n // 2)
    if limit < 1:
        return None
    rates = np.empty(limit + 1)
    rates[0] = 0.0
    for lag in range(1, limit + 1):  # one vectorised comparison per lag, not per event
        rates[lag] = np.count_nonzero(sig[:-lag] == sig[lag:]) / (n - lag)
    best = rates.max()
    if best < min_match:
        return None
    period = int(np.flatnonzero(rates >= best - tolerance)[0])
    codes, counts = np.unique(sig, return_counts=True)
    expected = n / period
    once = codes[np.abs(counts - expected) <= 1 + 0.05 * expected]
    if once.size == 0:
        return None
    gap = np.empty(n, dtype=np.float64)
    gap[0] = 0.0
    gap[1:] = start_ns[1:] - end_ns[:-1]
    best_anchor, best_gap = int(once[0]), -np.inf
    for code in once:  # a handful of candidates
        g = float(np.median(gap[sig == code]))
        if g > best_gap:
            best_anchor, best_gap = int(code), g
    return Period(period=period, anchor=best_anchor, match=float(rates[period]))
