"""Generated training traces with their own ground truth (no processes, no clocks).

A deterministic dependency scheduler runs a Megatron-style program on every rank of a
TP x CP x DP x PP layout (1F1B pipeline schedule with batched send/recv, tensor-parallel
all-reduces, context-parallel all-gathers, distributed-optimizer parameter all-gather and
gradient reduce-scatter, the embedding all-reduce between first and last stage) and writes what
each rank did in the ByteDance trace format (``dp_rank, stage, rank, step, optype, start_ts,
duration, seq_id``) that the OSDI'25 straggler study published, with compute rows, plus
``tp_rank``, ``peer`` and ``pg`` (the process group) so that matching does not depend on
inference.

A collective ends when its last member has arrived plus its transfer time; a batch of
send/receive operations ends when every transfer in it has (each transfer once both sides have
posted it). Durations carry seeded multiplicative noise. Faults make a set of ranks' compute
slower (optionally one phase only), a group's communication slower, or a rank late by a fixed
delay before one operation of every step.

Ground truth (``GeneratedJob.truth``): the observed mean step time; the ideal one (the same
program replayed with every duration at its nominal value: no noise, no fault) and the ratio
(``slowdown``); the what-if study's ideal (every operation at its mean true duration over ranks
and steps, no noise) and that ratio (``slowdown_vs_mean``); the faulty ranks; every step's true
start (the first operation of the step on any rank).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl

MS = 1e-3  # the format's times are seconds


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    microbatches: int = 4
    forward_ms: float = 6.0  # one microbatch's forward compute on one stage
    backward_ms: float = 12.0
    optimizer_ms: float = 8.0
    # Interleaved pipeline (Megatron's virtual stages): each rank holds ``virtual`` model chunks, the
    # last stage's chunk c sends to the first stage's chunk c + 1 (the pipelines become rings).
    virtual: int = 1
    # ZeRO-3 / FSDP (no pipeline): parameters gathered per layer before its forward and its backward,
    # gradients reduce-scattered per layer after its backward; 0 = the distributed optimizer's one
    # all-gather and one reduce-scatter per step.
    fsdp_layers: int = 0
    # Hybrid sharding (HSDP): parameters sharded over groups of ``fsdp_shard`` consecutive ranks, the
    # gradients of each layer then all-reduced across the groups (0: one group of every rank).
    fsdp_shard: int = 0
    # With context parallelism, Megatron also builds a plain data-parallel group (same CP index, without
    # the CP ranks) beside the DP-with-CP group the gradients use: one small all-reduce a step on it (the
    # loss averaged over the replicas), after the gradients' reduce-scatter. Fault group ``dpo``.
    plain_dp: bool = False

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def coords(self, rank: int) -> dict[str, int]:
        """Megatron's order: tensor parallel fastest, then context, data, pipeline."""
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        return {"tp": tp, "cp": cp, "dp": dp, "pp": pp, "shard": dp // self.fsdp_shard if self.fsdp_shard else 0}

    def rank(self, tp: int, cp: int, dp: int, pp: int) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))


@dataclass(frozen=True)
class Variation:
    """What changes from step to step in a job's program; all off (the default): every step the same.

    Any of them on, the trace also carries each operation's ``bytes`` (activations 16 MiB per
    micro-batch, parameters and gradients 256 MiB per stage, 4 bytes for a flag or a barrier), so
    that sizes can vary. The draws are the job's own (seeded from ``generate``'s seed and the step),
    the same on every rank, and the ground truth (each step's first operation) is unchanged by them.

    ``seq_spread``: the sequence length of each step is drawn within +-``seq_spread`` of nominal
    (variable-length batches); activation messages (tensor- and context-parallel collectives,
    pipeline transfers, all-to-alls) and the compute on them scale with it.
    ``moe``: mixture-of-experts layers: per micro-batch, forward and backward, an all-to-all dispatch
    and combine over the expert-parallel group (the stage's data-parallel ranks of one TP and CP
    index); the tokens routed to a rank vary per step, micro-batch and rank (x0.5-1.5).
    ``checkpoint_every``: every N-th step ends, after the optimizer, with a 4-byte world all-reduce (a
    barrier) and the save (compute): a longer step with an extra collective.
    ``loss_scale_share``: that share of steps (drawn) carries an extra 4-byte all-reduce over the
    data-parallel group after the gradients' reduce-scatter (the loss scale backed off after an overflow).
    ``microbatch_spread``: the micro-batches of each step (the gradient accumulation count) are drawn
    within +-``microbatch_spread`` of ``Layout.microbatches`` (at least 1).
    """

    seq_spread: float = 0.0
    moe: bool = False
    checkpoint_every: int = 0
    loss_scale_share: float = 0.0
    microbatch_spread: int = 0

    @property
    def active(self) -> bool:
        return self != Variation()


@dataclass(frozen=True)
class _StepShape:
    """One step's draws of a ``Variation`` (the same on every rank)."""

    seq: float = 1.0  # sequence length, relative to nominal
    microbatches: int = 0  # 0: the layout's
    checkpoint: bool = False
    loss_scale: bool = False
    routed: tuple = ()  # MoE: per (micro-batch, direction) an array of each rank's routing factor
    sized: bool = False  # write bytes


ACT_BYTES = 16 << 20  # one micro-batch's activations
PARAM_BYTES = 256 << 20  # a stage's parameters (and gradients)
FLAG_BYTES = 4


def _step_shapes(layout: Layout, variation: Variation, steps: int, seed: int) -> list[_StepShape]:
    if not variation.active:
        return [_StepShape() for _ in range(steps)]
    if layout.fsdp_layers or layout.virtual > 1:
        raise ValueError("Variation: the 1F1B program only (no fsdp_layers, no virtual stages)")
    shapes = []
    for k in range(steps):
        rng = np.random.default_rng([seed, 3, k])
        seq = 1.0 + float(rng.uniform(-variation.seq_spread, variation.seq_spread))
        m = layout.microbatches + int(rng.integers(-variation.microbatch_spread, variation.microbatch_spread + 1))
        loss_scale = bool(rng.random() < variation.loss_scale_share)
        m = max(1, m)
        routed = tuple(rng.uniform(0.5, 1.5, size=layout.world) for _ in range(2 * m)) if variation.moe else ()
        every = variation.checkpoint_every
        shapes.append(
            _StepShape(
                seq=seq,
                microbatches=m,
                checkpoint=bool(every) and k % every == every - 1,
                loss_scale=loss_scale,
                routed=routed,
                sized=True,
            )
        )
    return shapes


@dataclass(frozen=True)
class Fault:
    """What is slow. ``where`` selects ranks by coordinate (``{"dp": 1}``, ``{"pp": 1}``, ``{"rank": 5}``).

    kind ``compute``: compute of the selected ranks takes ``factor`` times longer (``phase``:
    ``forward``, ``backward`` or ``all``). kind ``comm``: transfers of ``group`` collectives
    (``dp``, ``tp``, ``cp``, ``pp`` for send/recv) that involve a selected rank take ``factor``
    times longer. kind ``late``: each selected rank waits ``delay_ms`` before its first
    ``before`` operation (e.g. ``tp-all-reduce``) of every step. ``spread``: the factor (or the
    delay, as a share of it) varies from step to step, drawn uniformly within +-``spread`` of it
    (a rank 2-8% slow: ``factor=1.05, spread=0.03``), from a generator of its own so that the job's
    noise draws stay those of the same job without the fault.
    """

    kind: str
    where: dict[str, int]
    factor: float = 1.0
    phase: str = "all"
    group: str = ""
    delay_ms: float = 0.0
    before: str = ""
    spread: float = 0.0

    def hits(self, layout: Layout, rank: int) -> bool:
        c = {**layout.coords(rank), "rank": rank}
        return all(c[k] == v for k, v in self.where.items())


@dataclass
class GeneratedJob:
    layout: Layout
    table: pl.DataFrame  # ByteDance trace format, one row per operation per rank
    truth: dict = field(default_factory=dict)

    def write(self, path: Path) -> Path:
        path = Path(path)
        self.table.write_parquet(path)
        return path

    def communication_only(self) -> pl.DataFrame:
        """The same trace without compute rows and without step labels."""
        return self.table.filter(~pl.col("optype").str.contains("compute|optimizer")).drop("step")


@dataclass
class _Op:
    optype: str
    kind: str  # compute, coll, p2p
    nominal: float  # seconds: compute duration or transfer time
    key: tuple = ()  # shared by every member of one collective / both sides of one transfer
    members: int = 1
    peer: int = -1
    pg: str = ""
    gap: float = 20e-6  # launch gap before it
    nbytes: int = -1  # payload (-1: not written)


def _program(layout: Layout, rank: int, step: int, shape: _StepShape | None = None) -> list[list[_Op]]:
    """One rank's step as a list of batches (a batch: one compute, or operations posted together).

    ``shape``: the step's draws of the job's ``Variation`` (None: none)."""
    shape = shape or _StepShape()
    c = layout.coords(rank)
    s, last = c["pp"], layout.pp - 1
    m = shape.microbatches or layout.microbatches
    f = shape.seq

    def size(nbytes: float) -> int:
        return int(nbytes) if shape.sized else -1

    dp_ranks = layout.dp * layout.cp
    dp_pg = f"dp:pp{s}tp{c['tp']}"
    tp_pg = f"tp:pp{s}dp{c['dp']}cp{c['cp']}"
    cp_pg = f"cp:pp{s}dp{c['dp']}tp{c['tp']}"
    pp_pg = f"pp:dp{c['dp']}cp{c['cp']}tp{c['tp']}"
    out: list[list[_Op]] = []
    counter: dict[str, int] = {}

    def coll(optype: str, pg: str, members: int, ms: float, nbytes: int = -1) -> _Op:
        k = counter[optype] = counter.get(optype, -1) + 1
        return _Op(optype, "coll", ms * MS, key=(step, pg, optype, k), members=members, pg=pg, nbytes=nbytes)

    def p2p(optype: str, direction: str, mb: int, to_stage: int, sending: bool) -> _Op:
        peer = layout.rank(c["tp"], c["cp"], c["dp"], to_stage)
        src, dst = (s, to_stage) if sending else (to_stage, s)
        key = (step, pp_pg, direction, mb, src, dst)
        return _Op(optype, "p2p", 0.4 * f * MS, key=key, members=2, peer=peer, pg=pp_pg, nbytes=size(ACT_BYTES * f))

    def experts(mb: int, backward: bool) -> None:
        # MoE: dispatch then combine over the stage's expert-parallel group (its DP ranks of one TP and CP index).
        ep_pg = f"ep:pp{s}tp{c['tp']}cp{c['cp']}"
        for i, name in enumerate(("dispatch", "combine")):
            routed = shape.routed[2 * mb + backward]
            group = [layout.rank(c["tp"], c["cp"], d, s) for d in range(layout.dp)]
            slowest = float(max(routed[g] for g in group))
            phase = "backward" if backward else "forward"
            nbytes = size(ACT_BYTES * f * routed[rank])
            out.append([coll(f"{phase}-{name}-all-to-all", ep_pg, layout.dp, 0.3 * f * slowest, nbytes)])
            if i == 0:
                ms = (layout.backward_ms if backward else layout.forward_ms) * 0.25 * f
                out.append([_Op(f"{phase}-compute", "compute", ms * MS)])

    def forward(mb: int) -> None:
        if layout.cp > 1:
            out.append([coll("cp-all-gather", cp_pg, layout.cp, 0.3 * f, size(ACT_BYTES * f / layout.cp))])
        out.append([_Op("forward-compute", "compute", layout.forward_ms * f * MS)])
        if shape.routed and layout.dp > 1:
            experts(mb, False)
        if layout.tp > 1:
            out.append([coll("tp-all-reduce", tp_pg, layout.tp, 0.2 * f, size(ACT_BYTES * f))])

    def backward(mb: int) -> None:
        if shape.routed and layout.dp > 1:
            experts(mb, True)
        out.append([_Op("backward-compute", "compute", layout.backward_ms * f * MS)])
        if layout.tp > 1:
            out.append([coll("tp-all-reduce", tp_pg, layout.tp, 0.2 * f, size(ACT_BYTES * f))])
        if layout.cp > 1:
            out.append([coll("cp-reduce-scatter", cp_pg, layout.cp, 0.3 * f, size(ACT_BYTES * f / layout.cp))])

    def batch(*ops: _Op | None) -> None:
        got = [o for o in ops if o is not None]
        if got:
            out.append(got)

    send_f = lambda mb: p2p("forward-send", "f", mb, s + 1, True) if s < last else None  # noqa: E731
    recv_f = lambda mb: p2p("forward-recv", "f", mb, s - 1, False) if s > 0 else None  # noqa: E731
    send_b = lambda mb: p2p("backward-send", "b", mb, s - 1, True) if s > 0 else None  # noqa: E731
    recv_b = lambda mb: p2p("backward-recv", "b", mb, s + 1, False) if s < last else None  # noqa: E731

    if layout.fsdp_layers:
        return _fsdp_program(layout, rank, step, coll, dp_pg, dp_ranks)
    if layout.virtual > 1:
        return _interleaved_program(layout, rank, step, coll, dp_pg, dp_ranks)
    if dp_ranks > 1:
        out.append([coll("params-all-gather", dp_pg, dp_ranks, 2.0, size(PARAM_BYTES))])
    # Megatron's 1F1B: warm-up forwards, steady state one forward one backward, cool-down backwards.
    warm = min(layout.pp - s - 1, m)
    for mb in range(warm):
        batch(recv_f(mb))
        forward(mb)
        batch(send_f(mb))
    steady = m - warm
    if steady:
        batch(recv_f(warm))
    for i in range(steady):
        forward(warm + i)
        batch(send_f(warm + i), recv_b(i))
        backward(i)
        if i == steady - 1:
            batch(send_b(i))
        else:
            batch(send_b(i), recv_f(warm + i + 1))
    for mb in range(steady, m):
        batch(recv_b(mb))
        backward(mb)
        batch(send_b(mb))
    if layout.pp > 1 and s in (0, last):
        emb_pg = f"emb:dp{c['dp']}cp{c['cp']}tp{c['tp']}"
        out.append([coll("embedding-grads-all-reduce", emb_pg, 2, 0.5, size(PARAM_BYTES / 8))])
    if dp_ranks > 1:
        out.append([coll("grads-reduce-scatter", dp_pg, dp_ranks, 2.0, size(PARAM_BYTES))])
    if shape.loss_scale and dp_ranks > 1:
        out.append([coll("loss-scale-all-reduce", dp_pg, dp_ranks, 0.05, size(FLAG_BYTES))])
    if layout.plain_dp and layout.cp > 1 and layout.dp > 1:
        out.append([coll("loss-all-reduce", f"dpo:pp{s}tp{c['tp']}cp{c['cp']}", layout.dp, 0.5)])
    out.append([_Op("optimizer", "compute", layout.optimizer_ms * MS)])
    if shape.checkpoint:
        out.append([coll("checkpoint-barrier", "world", layout.world, 0.05, size(FLAG_BYTES))])
        out.append([_Op("checkpoint-save-compute", "compute", 4 * layout.optimizer_ms * MS)])
    return out


def _fsdp_program(layout: Layout, rank: int, step: int, coll, dp_pg: str, dp_ranks: int) -> list[list[_Op]]:
    """ZeRO-3 / FSDP over the data-parallel ranks: per layer all-gather, compute, and in backward a reduce-scatter.

    With ``fsdp_shard`` (HSDP) the all-gathers and reduce-scatters run in the rank's shard group and
    each layer's reduced gradients are then all-reduced across the shard groups."""
    if layout.pp > 1 or layout.tp > 1 or layout.cp > 1:
        raise ValueError("fsdp_layers: a data-parallel-only layout")
    n, size = layout.fsdp_layers, layout.fsdp_shard or dp_ranks
    if dp_ranks % size:
        raise ValueError("fsdp_shard must divide the data-parallel ranks")
    shard_pg = f"dp:shard{rank // size}" if layout.fsdp_shard else dp_pg
    out: list[list[_Op]] = []
    for _ in range(n):
        out.append([coll("params-all-gather", shard_pg, size, 1.2 / n * 4)])
        out.append([_Op("forward-compute", "compute", layout.forward_ms * layout.microbatches / n * MS)])
    for _ in range(n):
        out.append([coll("params-all-gather", shard_pg, size, 1.2 / n * 4)])
        out.append([_Op("backward-compute", "compute", layout.backward_ms * layout.microbatches / n * MS)])
        out.append([coll("grads-reduce-scatter", shard_pg, size, 1.2 / n * 4)])
        if size < dp_ranks:
            out.append([coll("grads-all-reduce", f"dpr:{rank % size}", dp_ranks // size, 0.6 / n * 4)])
    out.append([_Op("optimizer", "compute", layout.optimizer_ms * MS)])
    return out


def _interleaved_program(layout: Layout, rank: int, step: int, coll, dp_pg: str, dp_ranks: int) -> list[list[_Op]]:
    """Megatron's interleaved 1F1B: ``virtual`` chunks per rank, virtual stage ``chunk * pp + stage``.

    Forward k runs chunk ``(k // pp) % v`` of microbatch ``(k // (pp * v)) * pp + k % pp`` (backward k
    the chunks in reverse); warm-up ``(pp - stage - 1) * 2 + (v - 1) * pp`` forwards, then one forward
    one backward; each send is posted together with the next receive, as Megatron batches them.
    """
    c = layout.coords(rank)
    s, pp, v, m = c["pp"], layout.pp, layout.virtual, layout.microbatches
    if m % pp:
        raise ValueError("interleaved schedule: microbatches must be a multiple of pp")
    last_vs = pp * v - 1
    pp_pg = f"pp:dp{c['dp']}cp{c['cp']}tp{c['tp']}"
    out: list[list[_Op]] = []

    def chunk_mb(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k % (pp * v)) // pp
        return (v - 1 - chunk if backward else chunk), (k // (pp * v)) * pp + k % pp

    def p2p(optype: str, direction: str, mb: int, src_vs: int, dst_vs: int, sending: bool) -> _Op:
        other_vs = dst_vs if sending else src_vs
        peer = layout.rank(c["tp"], c["cp"], c["dp"], other_vs % pp)
        return _Op(
            optype, "p2p", 0.4 * MS, key=(step, pp_pg, direction, mb, src_vs, dst_vs), members=2, peer=peer, pg=pp_pg
        )

    def tp_ar() -> None:
        if layout.tp > 1:
            out.append([coll("tp-all-reduce", f"tp:pp{s}dp{c['dp']}cp{c['cp']}", layout.tp, 0.2)])

    total = m * v
    items = []  # (backward?, k)
    warm = min((pp - s - 1) * 2 + (v - 1) * pp, total)
    items += [(False, k) for k in range(warm)]
    for i in range(total - warm):
        items += [(False, warm + i), (True, i)]
    items += [(True, k) for k in range(total - warm, total)]

    def recv_for(item: tuple[bool, int]) -> _Op | None:
        back, k = item
        chunk, mb = chunk_mb(k, back)
        vs = chunk * pp + s
        if not back and vs > 0:
            return p2p("forward-recv", "f", mb, vs - 1, vs, False)
        if back and vs < last_vs:
            return p2p("backward-recv", "b", mb, vs + 1, vs, False)
        return None

    def send_after(item: tuple[bool, int]) -> _Op | None:
        back, k = item
        chunk, mb = chunk_mb(k, back)
        vs = chunk * pp + s
        if not back and vs < last_vs:
            return p2p("forward-send", "f", mb, vs, vs + 1, True)
        if back and vs > 0:
            return p2p("backward-send", "b", mb, vs, vs - 1, True)
        return None

    if dp_ranks > 1:
        out.append([coll("params-all-gather", dp_pg, dp_ranks, 2.0)])
    first = recv_for(items[0])
    if first is not None:
        out.append([first])
    for j, item in enumerate(items):
        back, _ = item
        out.append(
            [
                _Op(
                    f"{'backward' if back else 'forward'}-compute",
                    "compute",
                    (layout.backward_ms if back else layout.forward_ms) / v * MS,
                )
            ]
        )
        tp_ar()
        nxt = recv_for(items[j + 1]) if j + 1 < len(items) else None
        got = [o for o in (send_after(item), nxt) if o is not None]
        if got:
            out.append(got)
    if s in (0, pp - 1):
        out.append([coll("embedding-grads-all-reduce", f"emb:dp{c['dp']}cp{c['cp']}tp{c['tp']}", 2, 0.5)])
    if dp_ranks > 1:
        out.append([coll("grads-reduce-scatter", dp_pg, dp_ranks, 2.0)])
    out.append([_Op("optimizer", "compute", layout.optimizer_ms * MS)])
    return out


def _schedule(layout: Layout, programs: list[list[list[_Op]]], durations: list[list[list[float]]]) -> list[list]:
    """Run every rank's batches; per rank a list of (batch index, start, end per op)."""
    n = layout.world
    ptr = [0] * n
    clock = [0.0] * n
    posted: dict[tuple, dict[int, float]] = {}
    done: dict[tuple, float] = {}
    times: list[list] = [[] for _ in range(n)]
    arrival: dict[tuple[int, int], float] = {}
    progress = True
    while progress:
        progress = False
        for r in range(n):
            prog, dur = programs[r], durations[r]
            while ptr[r] < len(prog):
                b = ptr[r]
                ops = prog[b]
                if (r, b) not in arrival:
                    arrival[(r, b)] = clock[r] + ops[0].gap
                start = arrival[(r, b)]
                if ops[0].kind == "compute":
                    end = start + dur[b][0]
                    times[r].append((b, start, [end]))
                    clock[r], ptr[r], progress = end, b + 1, True
                    continue
                ends = []
                for o, d in zip(ops, dur[b], strict=True):
                    got = posted.setdefault(o.key, {})
                    got[r] = start
                    if o.key not in done and len(got) == o.members:
                        done[o.key] = max(got.values()) + d
                    ends.append(done.get(o.key))
                if any(e is None for e in ends):
                    break
                end = max(ends)
                times[r].append((b, start, [end] * len(ops)))
                clock[r], ptr[r], progress = end, b + 1, True
    if any(ptr[r] < len(programs[r]) for r in range(n)):
        raise RuntimeError("generated program deadlocked")  # a bug in _program, never an input error
    return times


def generate(
    layout: Layout,
    steps: int = 6,
    faults: tuple[Fault, ...] = (),
    noise: float = 0.02,
    seed: int = 0,
    first_step: int = 100,
    tail: float = 0.0,
    variation: Variation = Variation(),
) -> GeneratedJob:
    """A trace of ``steps`` steps (labelled from ``first_step``) with its ground truth (module doc).

    ``variation``: what changes from step to step (``Variation``; the default: nothing, no ``bytes``).

    ``tail``: heavy-tailed noise on top of the lognormal one: that share of operations (compute and
    transfers) takes ``1 + 0.1 * X`` times longer, X Pareto-distributed (Lomax, shape 1.5: mean 2,
    unbounded variance; one hiccup in a few hundred is 5x or more), drawn from a generator of its own.
    """
    rng = np.random.default_rng(seed)
    tails = np.random.default_rng([seed, 1])
    # Per fault and step, the factor (or the share of the delay) that step gets: see ``Fault.spread``.
    per_step = [
        1.0
        + np.random.default_rng([seed, 2, i]).uniform(-f.spread, f.spread, size=steps)
        / (f.factor if f.kind != "late" else 1.0)
        if f.spread > 0
        else np.ones(steps)
        for i, f in enumerate(faults)
    ]
    n = layout.world
    shapes = _step_shapes(layout, variation, steps, seed)
    programs: list[list[list[_Op]]] = []
    step_of: list[list[int]] = []
    for r in range(n):
        prog: list[list[_Op]] = []
        labels: list[int] = []
        for k in range(steps):
            p = _program(layout, r, k, shapes[k])
            prog += p
            labels += [k] * len(p)
        programs.append(prog)
        step_of.append(labels)
    nominal = [[[o.nominal for o in b] for b in prog] for prog in programs]
    observed: list[list[list[float]]] = []
    for r in range(n):
        per_rank = []
        for ops in programs[r]:
            jitter = rng.lognormal(0.0, noise, size=len(ops)) if noise > 0 else np.ones(len(ops))
            if tail > 0:
                hit = tails.random(len(ops)) < tail
                jitter = jitter * np.where(hit, 1.0 + 0.1 * tails.pareto(1.5, size=len(ops)), 1.0)
            per_rank.append([o.nominal * float(j) for o, j in zip(ops, jitter, strict=True)])
        observed.append(per_rank)
    faulty: set[int] = set()
    late: dict[tuple[int, int], float] = {}
    for f, scale in zip(faults, per_step, strict=True):
        hit = {r for r in range(n) if f.hits(layout, r)}
        faulty |= hit
        for r in hit:
            seen: set[int] = set()
            for b, ops in enumerate(programs[r]):
                factor = f.factor * scale[step_of[r][b]]
                for i, o in enumerate(ops):
                    if f.kind == "compute" and o.kind == "compute" and o.optype != "optimizer":
                        if f.phase == "all" or o.optype.startswith(f.phase):
                            observed[r][b][i] *= factor
                    elif f.kind == "comm" and o.kind != "compute" and o.pg.startswith(f.group + ":"):
                        observed[r][b][i] *= factor
                    elif f.kind == "late" and o.optype == f.before and step_of[r][b] not in seen:
                        seen.add(step_of[r][b])
                        late[(r, b)] = late.get((r, b), 0.0) + f.delay_ms * MS * scale[step_of[r][b]]
    # A transfer's time is one value for all its members: the slowest member's draw.
    for prog_ops, dur in ((programs, observed),):
        worst: dict[tuple, float] = {}
        for r in range(n):
            for b, ops in enumerate(prog_ops[r]):
                for i, o in enumerate(ops):
                    if o.kind != "compute":
                        worst[o.key] = max(worst.get(o.key, 0.0), dur[r][b][i])
        for r in range(n):
            for b, ops in enumerate(prog_ops[r]):
                for i, o in enumerate(ops):
                    if o.kind != "compute":
                        dur[r][b][i] = worst[o.key]
    # Launch gaps carry the same noise; a late rank's delay is added to one gap per step.
    for r in range(n):
        for b, ops in enumerate(programs[r]):
            g = ops[0].gap * float(rng.lognormal(0.0, noise)) if noise > 0 else ops[0].gap
            g += late.get((r, b), 0.0)
            programs[r][b] = [_Op(**{**o.__dict__, "gap": g}) for o in ops]
    times = _schedule(layout, programs, observed)
    # The what-if study's ideal: each operation at its mean (no noise) over ranks and steps, per
    # operation and occurrence in the step; each gap at its mean between the same two operations.
    true = [[[d for d in b] for b in prog] for prog in nominal]
    for f, scale in zip(faults, per_step, strict=True):
        if f.kind in ("compute", "comm"):
            for r in range(n):
                if not f.hits(layout, r):
                    continue
                for b, ops in enumerate(programs[r]):
                    factor = f.factor * scale[step_of[r][b]]
                    for i, o in enumerate(ops):
                        if f.kind == "compute" and o.kind == "compute" and o.optype != "optimizer":
                            if f.phase == "all" or o.optype.startswith(f.phase):
                                true[r][b][i] *= factor
                        elif f.kind == "comm" and o.kind != "compute" and o.pg.startswith(f.group + ":"):
                            true[r][b][i] *= factor
    dur_sum: dict[tuple, list[float]] = {}
    gap_sum: dict[tuple, list[float]] = {}
    places: list[list[tuple[list[tuple], tuple]]] = []
    for r in range(n):
        seen: dict[tuple, int] = {}
        prev_name = ""
        per_rank = []
        for b, ops in enumerate(programs[r]):
            keys = []
            for o in ops:
                k = (step_of[r][b], o.optype)
                seen[k] = seen.get(k, -1) + 1
                keys.append((o.optype, seen[k]))
            gkey = (prev_name, keys[0])
            prev_name = ops[-1].optype
            per_rank.append((keys, gkey))
            for key, d in zip(keys, true[r][b], strict=True):
                dur_sum.setdefault(key, []).append(d)
            gap_sum.setdefault(gkey, []).append(20e-6 + late.get((r, b), 0.0))
        places.append(per_rank)
    mean_dur = [[[float(np.mean(dur_sum[k])) for k in keys] for keys, _ in per_rank] for per_rank in places]
    mean_programs = [
        [
            [_Op(**{**o.__dict__, "gap": float(np.mean(gap_sum[places[r][b][1]]))}) for o in ops]
            for b, ops in enumerate(prog)
        ]
        for r, prog in enumerate(programs)
    ]
    mean_times = _schedule(layout, mean_programs, mean_dur)
    ideal_programs = [[[_Op(**{**o.__dict__, "gap": 20e-6}) for o in b] for b in prog] for prog in programs]
    ideal_times = _schedule(layout, ideal_programs, nominal)

    rows: dict[str, list] = {
        k: [] for k in ("dp_rank", "stage", "rank", "step", "optype", "start_ts", "duration", "seq_id")
    } | {"tp_rank": [], "cp_rank": [], "peer": [], "pg": [], "bytes": []}
    for r in range(n):
        c = layout.coords(r)
        seq: dict[tuple[int, str], int] = {}
        for b, start, ends in times[r]:
            for o, end in zip(programs[r][b], ends, strict=True):
                k = (step_of[r][b], o.optype)
                seq[k] = seq.get(k, -1) + 1
                rows["dp_rank"].append(c["dp"])
                rows["stage"].append(c["pp"])
                rows["tp_rank"].append(c["tp"])
                rows["cp_rank"].append(c["cp"])
                rows["rank"].append(r)
                rows["step"].append(first_step + step_of[r][b])
                rows["optype"].append(o.optype)
                rows["start_ts"].append(start)
                rows["duration"].append(end - start)
                rows["seq_id"].append(seq[k])
                rows["peer"].append(o.peer if o.peer >= 0 else None)
                rows["pg"].append(o.pg or f"local:{r}")
                rows["bytes"].append(o.nbytes if o.nbytes >= 0 else None)
    if not variation.active:
        del rows["bytes"]  # the traces written before variations had none
    table = pl.DataFrame(rows).sort("rank", "start_ts")

    def step_bounds(ts: list[list]) -> tuple[np.ndarray, float]:
        starts = np.full(steps, np.inf)
        last_end = 0.0
        for r in range(n):
            for b, start, ends in ts[r]:
                k = step_of[r][b]
                starts[k] = min(starts[k], start)
                last_end = max(last_end, max(ends))
        return starts, (last_end - starts[0]) / steps

    true_starts, observed_step = step_bounds(times)
    _, ideal_step = step_bounds(ideal_times)
    _, mean_step = step_bounds(mean_times)
    truth = {
        "observed_step_s": observed_step,
        "ideal_step_s": ideal_step,
        "slowdown": observed_step / ideal_step,
        "mean_ideal_step_s": mean_step,
        "slowdown_vs_mean": observed_step / mean_step,
        "culprits": sorted(faulty),
        "step_starts_s": true_starts.tolist(),
        "steps": [first_step + k for k in range(steps)],
    }
    return GeneratedJob(layout=layout, table=table, truth=truth)


def write_kineto(
    out: Path,
    ranks: int = 8,
    steps: int = 8,
    slow_rank: int = -1,
    slow_factor: float = 1.0,
    sleep_ms: float = 0.0,
    noise: float = 0.03,
    seed: int = 0,
    step_ms: float = 1400.0,
) -> dict:
    """PyTorch profiler (Kineto) JSON traces of a data-parallel job, one file per rank, and their truth.

    Per step and rank: a forward kernel, then (on ``slow_rank``) ``sleep_ms`` on the CPU before
    backward, then backward in gradient buckets, each a compute kernel followed by an NCCL
    all-reduce over all ranks (``record_param_comms`` plus the kernel, with the collective
    arguments PyTorch writes; NCCL 2.17 kernel names), under a ``ProfilerStep#N`` annotation.
    ``slow_rank`` also computes ``slow_factor`` times slower. Returns the truth: mean step time
    observed and ideal (no noise, no fault), their ratio, the culprit.
    """
    out = Path(out)
    buckets, nelems = 6, 6_291_456
    # A step of about ``step_ms``: forward 30%, backward 60% in buckets, all-reduces 6%, optimizer.
    forward_us, compute_us, transfer_us = 0.3 * step_ms * 1e3, 0.1 * step_ms * 1e3, 0.01 * step_ms * 1e3
    group = list(range(ranks))
    pg = {
        "Collective name": "allreduce",
        "In msg nelems": nelems,
        "Out msg nelems": nelems,
        "Group size": ranks,
        "dtype": "BFloat16",
        "Process Group Name": "0",
        "Process Group Description": "default_pg",
        "Process Group Ranks": json.dumps(group),
    }

    def run(jitter: float, factor: float, sleep_us: float, record: bool) -> tuple[list[list[dict]], float]:
        rng = np.random.default_rng(seed)
        clock = np.zeros(ranks)
        events: list[list[dict]] = [[] for _ in range(ranks)]
        ids = [[1000, 50_000] for _ in range(ranks)]

        def kernel(r: int, name: str, ts: float, dur: float, stream: int, args: dict | None = None) -> None:
            if not record:
                return
            ids[r][0] += 1
            ids[r][1] += 1
            ext, corr = ids[r]
            events[r].append(
                {
                    "ph": "X",
                    "cat": "cuda_runtime",
                    "name": "cudaLaunchKernel",
                    "pid": 100 + r,
                    "tid": 100 + r,
                    "ts": ts - 8.0,
                    "dur": 4.0,
                    "args": {"External id": ext, "correlation": corr, "cbid": 211},
                }
            )
            events[r].append(
                {
                    "ph": "X",
                    "cat": "kernel",
                    "name": name,
                    "pid": 0,
                    "tid": stream,
                    "ts": ts,
                    "dur": dur,
                    "args": {"External id": ext, "correlation": corr, "device": r, "stream": stream, **(args or {})},
                }
            )

        def draw(r: int) -> float:
            return float(rng.lognormal(0.0, jitter)) * (factor if r == slow_rank else 1.0)

        starts = []
        for step in range(steps):
            step_start = clock.copy()
            starts.append(step_start.min())
            for r in range(ranks):
                dur = forward_us * draw(r)
                kernel(r, "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", clock[r] + 5.0, dur, 7)
                clock[r] += 5.0 + dur + (sleep_us if r == slow_rank else 0.0)
            for _ in range(buckets):
                arrival = np.empty(ranks)
                for r in range(ranks):
                    work = compute_us * draw(r)
                    kernel(r, "sm90_xmma_gemm_bf16bf16_bf16f32_f32_nt_n_tilesize128x128x64", clock[r] + 5.0, work, 7)
                    arrival[r] = clock[r] + 5.0 + work + 20.0
                end = arrival.max() + transfer_us
                for r in range(ranks):
                    if record:
                        ids[r][0] += 1
                        events[r].append(
                            {
                                "ph": "X",
                                "cat": "cpu_op",
                                "name": "record_param_comms",
                                "pid": 100 + r,
                                "tid": 100 + r,
                                "ts": arrival[r] - 20.0,
                                "dur": 10.0,
                                "args": {"External id": ids[r][0], **pg},
                            }
                        )
                    kernel(
                        r,
                        "ncclKernel_AllReduce_RING_LL_Sum_bfloat16(ncclDevComm*, unsigned long, ncclWork*)",
                        arrival[r],
                        end - arrival[r],
                        20,
                        args=pg,
                    )
                    clock[r] = end
            for r in range(ranks):
                if record:
                    events[r].append(
                        {
                            "ph": "X",
                            "cat": "user_annotation",
                            "name": f"ProfilerStep#{step}",
                            "pid": 100 + r,
                            "tid": 100 + r,
                            "ts": step_start[r] - 20.0,
                            "dur": clock[r] - step_start[r] + 30.0,
                            "args": {"External id": 0},
                        }
                    )
            clock += 0.03 * step_ms * 1e3  # optimizer step
        return events, (clock.max() - starts[0]) / steps

    events, observed = run(noise, slow_factor, sleep_ms * 1e3, True)
    _, ideal = run(0.0, 1.0, 0.0, False)
    out.mkdir(parents=True, exist_ok=True)
    for r in range(ranks):
        doc = {
            "schemaVersion": 1,
            "deviceProperties": [{"id": r, "name": "NVIDIA H200", "totalGlobalMem": 150_000_000_000}],
            "distributedInfo": {
                "backend": "nccl",
                "rank": r,
                "world_size": ranks,
                "pg_count": 1,
                "pg_config": [
                    {
                        "pg_name": "0",
                        "pg_desc": "default_pg",
                        "backend_config": "cuda:nccl",
                        "pg_size": ranks,
                        "ranks": group,
                    }
                ],
                "nccl_version": "2.17.1",
            },
            "traceEvents": sorted(events[r], key=lambda e: e["ts"]),
            "traceName": f"rank{r}.json",
            "displayTimeUnit": "ms",
            "baseTimeNanoseconds": 1_700_000_000_000_000_000,
        }
        (out / f"rank-{r}.pt.trace.json").write_text(json.dumps(doc))
    faulty = slow_rank >= 0 and (slow_factor != 1.0 or sleep_ms > 0)
    return {
        "observed_step_s": observed / 1e6,
        "ideal_step_s": ideal / 1e6,
        "slowdown": observed / ideal,
        "culprits": [slow_rank] if faulty else [],
    }
