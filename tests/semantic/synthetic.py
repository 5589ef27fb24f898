"""Seeded synthetic training jobs as operations tables, with known steps and injected stragglers.

A tiny dependency simulator: every rank runs a program (compute gaps, collectives, sends and
receives); a collective ends when its last member has arrived plus a transfer time; a receive
ends when its send has arrived plus a transfer time. Layouts: DDP, FSDP, Megatron TP x PP x DP.
A straggler is a rank whose compute takes ``slow_factor`` times longer. ``measured_slowdown``
runs the same seed with and without the straggler, which is the ground truth for the what-if.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import polars as pl
import pyarrow as pa

from comminsight.evidence.schema import conform

MS = 1_000_000


@dataclass
class Op:
    kind: str  # "coll", "send", "recv"
    op: str
    comm: str
    nbytes: int
    gap: float  # compute before it, ns
    peer: int | None = None
    key: tuple = ()


@dataclass
class Job:
    ranks: int
    comms: dict[str, dict]  # comm_id -> {"ranks": [...], "desc": str}
    programs: dict[int, list[Op]] = field(default_factory=dict)
    step_of: dict[int, list[int]] = field(default_factory=dict)
    coords: dict[int, tuple[int, int, int]] | None = None


def _transfer(nbytes: int, slowness: float = 1.0) -> float:
    return 20_000 + slowness * nbytes / 50.0  # 50 GB/s plus 20 us latency, in ns


def simulate(job: Job) -> pl.DataFrame:
    """Run the programs; one row per operation per rank."""
    ptr = dict.fromkeys(range(job.ranks), 0)
    clock = dict.fromkeys(range(job.ranks), 0.0)
    arrival: dict[tuple[int, int], float] = {}
    coll_arrivals: dict[tuple, dict[int, float]] = {}
    send_arrival: dict[tuple, float] = {}
    seq: dict[tuple[int, str, bool], int] = {}
    rows: list[dict] = []

    def record(r: int, o: Op, start: float, end: float) -> None:
        members = job.comms[o.comm]["ranks"]
        p2p = o.kind != "coll"
        k = (r, o.comm, p2p)
        seq[k] = seq.get(k, -1) + 1
        rows.append(
            {
                "rank": r,
                "comm_id": o.comm,
                "comm_desc": job.comms[o.comm]["desc"],
                "comm_size": len(members),
                "comm_ranks": members,
                "comm_rank": members.index(r),
                "op": o.op,
                "is_p2p": p2p,
                "seq": seq[k],
                "bytes": o.nbytes,
                "peer": o.peer,
                "start_ns": int(start),
                "end_ns": int(end),
                "step": job.step_of[r][ptr[r]],
                "state": "completed",
                "source": "synthetic",
                **(
                    {"dp_rank": job.coords[r][0], "pp_rank": job.coords[r][1], "tp_rank": job.coords[r][2]}
                    if job.coords
                    else {}
                ),
            }
        )

    progress = True
    while progress:
        progress = False
        for r in range(job.ranks):
            prog = job.programs[r]
            while ptr[r] < len(prog):
                o = prog[ptr[r]]
                if (r, ptr[r]) not in arrival:
                    arrival[(r, ptr[r])] = clock[r] + o.gap
                a = arrival[(r, ptr[r])]
                if o.kind == "send":
                    send_arrival[o.key] = a
                    record(r, o, a, a + 5_000)
                    clock[r] = a + 5_000
                elif o.kind == "recv":
                    if o.key not in send_arrival:
                        break
                    end = max(a, send_arrival[o.key]) + _transfer(o.nbytes, job.comms[o.comm].get("slowness", 1.0))
                    record(r, o, a, end)
                    clock[r] = end
                else:
                    got = coll_arrivals.setdefault(o.key, {})
                    got[r] = a
                    members = job.comms[o.comm]["ranks"]
                    if len(got) < len(members):
                        break
                    end = max(got.values()) + _transfer(o.nbytes, job.comms[o.comm].get("slowness", 1.0))
                    for m in members:
                        mo = job.programs[m][ptr[m]]
                        record(m, mo, got[m], end)
                        clock[m] = end
                        if m != r:
                            ptr[m] += 1
                    progress = True
                ptr[r] += 1
                progress = True
    assert all(ptr[r] == len(job.programs[r]) for r in range(job.ranks)), "simulated job deadlocked"
    return pl.DataFrame(rows)


class _Builder:
    def __init__(self, job: Job, rng: np.random.Generator, slow: dict[int, float]) -> None:
        self.job, self.rng, self.slow = job, rng, slow
        self.counter: dict[str, int] = {}

    def compute(self, r: int, mean_ms: float) -> float:
        jitter = self.rng.normal(1.0, 0.02)
        return max(0.0, mean_ms * MS * jitter * self.slow.get(r, 1.0))

    def coll(self, members: list[int], comm: str, op: str, nbytes: int, step: int, gaps: dict[int, float]) -> None:
        n = self.counter[comm] = self.counter.get(comm, -1) + 1
        for r in members:
            self.job.programs.setdefault(r, []).append(Op("coll", op, comm, nbytes, gaps[r], key=(comm, n)))
            self.job.step_of.setdefault(r, []).append(step)

    def p2p(self, src: int, dst: int, comm: str, nbytes: int, step: int, gap_src: float, gap_dst: float) -> None:
        n = self.counter[comm + f"{src}>{dst}"] = self.counter.get(comm + f"{src}>{dst}", -1) + 1
        key = (comm, src, dst, n)
        self.job.programs.setdefault(src, []).append(Op("send", "send", comm, nbytes, gap_src, peer=dst, key=key))
        self.job.step_of.setdefault(src, []).append(step)
        self.job.programs.setdefault(dst, []).append(Op("recv", "recv", comm, nbytes, gap_dst, peer=src, key=key))
        self.job.step_of.setdefault(dst, []).append(step)


def ddp(ranks: int = 8, steps: int = 12, seed: int = 0, slow: dict[int, float] | None = None, buckets: int = 4) -> Job:
    """DDP: backward chunks each followed by a bucket all-reduce, then a loss all-reduce, then the optimizer."""
    rng = np.random.default_rng(seed)
    everyone = list(range(ranks))
    job = Job(ranks, {"world": {"ranks": everyone, "desc": "default_pg"}})
    b = _Builder(job, rng, slow or {})
    for step in range(steps):
        for i in range(buckets):
            fwd = 30.0 if i == 0 else 0.0
            gaps = {r: b.compute(r, fwd + 10.0) + (b.compute(r, 8.0) if (step and i == 0) else 0.0) for r in everyone}
            b.coll(everyone, "world", "all_reduce", 25 << 20 if i < buckets - 1 else 3 << 20, step, gaps)
        b.coll(everyone, "world", "all_reduce", 4, step, {r: b.compute(r, 0.5) for r in everyone})
    return job


def fsdp(ranks: int = 8, steps: int = 10, seed: int = 0, slow: dict[int, float] | None = None, layers: int = 4) -> Job:
    """FSDP: forward all-gather per layer; backward all-gather and reduce-scatter per layer; optimizer."""
    rng = np.random.default_rng(seed)
    everyone = list(range(ranks))
    job = Job(ranks, {"world": {"ranks": everyone, "desc": "default_pg"}})
    b = _Builder(job, rng, slow or {})
    for step in range(steps):
        for layer in range(layers):
            opt = 6.0 if (step and layer == 0) else 0.0
            b.coll(everyone, "world", "all_gather", 8 << 20, step, {r: b.compute(r, 5.0 + opt) for r in everyone})
        for layer in range(layers):
            if layer:
                b.coll(everyone, "world", "all_gather", 8 << 20, step, {r: b.compute(r, 1.0) for r in everyone})
            b.coll(everyone, "world", "reduce_scatter", 8 << 20, step, {r: b.compute(r, 9.0) for r in everyone})
    return job


def megatron(
    tp: int = 2,
    pp: int = 2,
    dp: int = 2,
    steps: int = 8,
    micro: int = 4,
    seed: int = 0,
    slow: dict[int, float] | None = None,
) -> Job:
    """Megatron TP x PP x DP, GPipe schedule, distributed optimizer (param all-gather, grad reduce-scatter)."""
    rng = np.random.default_rng(seed)
    ranks = tp * pp * dp

    def rank_of(d: int, p: int, t: int) -> int:
        return p * dp * tp + d * tp + t

    comms: dict[str, dict] = {}
    coords = {}
    for d in range(dp):
        for p in range(pp):
            comms[f"tp.d{d}p{p}"] = {
                "ranks": [rank_of(d, p, t) for t in range(tp)],
                "desc": "TENSOR_MODEL_PARALLEL_GROUP",
            }
            for t in range(tp):
                coords[rank_of(d, p, t)] = (d, p, t)
    for p in range(pp):
        for t in range(tp):
            comms[f"dp.p{p}t{t}"] = {"ranks": [rank_of(d, p, t) for d in range(dp)], "desc": "DATA_PARALLEL_GROUP"}
    for d in range(dp):
        for t in range(tp):
            comms[f"pp.d{d}t{t}"] = {
                "ranks": [rank_of(d, p, t) for p in range(pp)],
                "desc": "PIPELINE_MODEL_PARALLEL_GROUP",
            }
    job = Job(ranks, comms, coords=coords)
    b = _Builder(job, rng, slow or {})
    for step in range(steps):
        for p in range(pp):
            for t in range(tp):
                members = comms[f"dp.p{p}t{t}"]["ranks"]
                b.coll(
                    members,
                    f"dp.p{p}t{t}",
                    "all_gather",
                    16 << 20,
                    step,
                    {r: b.compute(r, 4.0 if step else 0.5) for r in members},
                )
        for phase in ("fwd", "bwd"):
            order = range(pp) if phase == "fwd" else range(pp - 1, -1, -1)
            for _ in range(micro):
                for p in order:
                    for d in range(dp):
                        group = comms[f"tp.d{d}p{p}"]["ranks"]
                        cost = 6.0 if phase == "fwd" else 12.0
                        b.coll(
                            group, f"tp.d{d}p{p}", "all_reduce", 4 << 20, step, {r: b.compute(r, cost) for r in group}
                        )
                        nxt = p + 1 if phase == "fwd" else p - 1
                        if 0 <= nxt < pp:
                            for t in range(tp):
                                b.p2p(
                                    rank_of(d, p, t),
                                    rank_of(d, nxt, t),
                                    f"pp.d{d}t{t}",
                                    2 << 20,
                                    step,
                                    1_000.0,
                                    1_000.0,
                                )
        for p in range(pp):
            for t in range(tp):
                members = comms[f"dp.p{p}t{t}"]["ranks"]
                b.coll(
                    members, f"dp.p{p}t{t}", "reduce_scatter", 16 << 20, step, {r: b.compute(r, 1.0) for r in members}
                )
        for d in range(dp):
            for p in range(pp):
                group = comms[f"tp.d{d}p{p}"]["ranks"]
                b.coll(group, f"tp.d{d}p{p}", "all_reduce", 8, step, {r: b.compute(r, 0.2) for r in group})
    return job


LAYOUTS = {"ddp": ddp, "fsdp": fsdp, "megatron": megatron}


def table(layout: str, slow_comms: dict[str, float] | None = None, **kwargs) -> pa.Table:
    """A conformed operations table for ``layout`` (see LAYOUTS) with known ``step`` labels.

    ``slow_comms`` makes a communicator's transfers that many times slower.
    """
    job = LAYOUTS[layout](**kwargs)
    for comm, slowness in (slow_comms or {}).items():
        job.comms[comm]["slowness"] = slowness
    frame = simulate(job)
    return conform(frame.sort("rank", "start_ns").to_arrow())


def measured_slowdown(layout: str, slow: dict[int, float], **kwargs) -> float:
    """Mean step time (completion to completion) with the stragglers over without (same seed)."""

    def mean_step(frame: pl.DataFrame) -> float:
        # Step time as a user sees it: from one step's completion to the next one's.
        ends = frame.group_by("step").agg(e=pl.col("end_ns").max()).sort("step").get_column("e").to_numpy()
        return float(np.mean(np.diff(ends)))

    with_slow = simulate(LAYOUTS[layout](slow=slow, **kwargs))
    without = simulate(LAYOUTS[layout](slow={}, **kwargs))
    return mean_step(with_slow) / mean_step(without)
