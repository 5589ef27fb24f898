"""A period anchor that is a pair (previous operation, operation) must open one step per period.

The engine cannot see adjacency: with the pair's classes (the previous operation closes, the operation
opens, every other one neutral), the operation opens a step after the previous one however many other
operations lie between. A pair that occurs once per period side by side may then also occur, apart,
elsewhere in the period and open a second step there.
"""

from __future__ import annotations

import numpy as np

from comminsight.semantic.engine import StepEngine
from comminsight.semantic.period import detect_period
from comminsight.semantic.roles import OP_CODE, ROLE_CODE, signatures
from comminsight.semantic.steps import run_engine

MS = 1_000_000


def _rank(steps: int) -> dict[str, np.ndarray]:
    """One rank whose step is A B C A C B (each operation twice, every neighbour pair once) and whose
    longest idle stretch lies between A and B: the pair (A, B) is the best-rated anchor, but B also
    follows A (C between) later in the step."""
    a, b, c = (
        int(signatures(np.array([ROLE_CODE[r]]), np.array([OP_CODE[o]]), np.array([1 << 20]))[0])
        for r, o in (("dp", "all_gather"), ("tp", "all_reduce"), ("pp", "send"))
    )
    program = [a, b, c, a, c, b]
    idle = [1, 30, 1, 1, 1, 1]  # ms before each operation
    sig, start = [], []
    t = 0
    for _ in range(steps):
        for s, gap in zip(program, idle, strict=True):
            t += gap * MS
            sig.append(s)
            start.append(t)
            t += MS
    n = len(sig)
    start_ns = np.asarray(start, np.int64)
    return {
        "rank": np.zeros(n, np.int64),
        "row": np.arange(n, dtype=np.int64),
        "sig": np.asarray(sig, np.int64),
        "role": np.asarray(sig, np.int64) // (64 * 16),
        "start_ns": start_ns,
        "end_ns": start_ns + MS,
    }


def test_a_pair_anchor_opens_one_step_per_period() -> None:
    events = _rank(steps=12)
    found = detect_period(events["sig"], events["start_ns"], events["end_ns"])
    assert found is not None
    assert found.period == 6
    engine = StepEngine(use_templates=False)
    _, steps, _ = run_engine(events, engine)
    assert engine.ranks[0].method == "period"
    assert steps.max() + 1 in (12, 13)  # one step per period (the trace's start may open one more)
    # Every recovered step is a whole period: six operations.
    sizes = np.bincount(steps[steps >= 0])
    assert set(sizes[1:-1].tolist()) == {6}
