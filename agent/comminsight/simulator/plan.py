"""The simulated job: configuration, communicators, per-rank schedules and the timing model.

Every rank process and the parent build the same ``Plan`` from the same ``SimulationConfig``
(the build is deterministic), so no schedule has to be shipped between processes. A plan is:

- communicators derived like torch/Megatron process groups (world, tp, pp, dp, mp), each with a
  commHash that is a stable function of the layout and the group, hence identical on members;
- one schedule per rank: a setup phase and ``steps`` steps, each a list of actions — ``Compute``
  (a CPU phase that may first wait for GPU work, as a kernel on the same stream would) and
  ``Launch`` (the operations of one ncclGroupStart/End, usually a single collective);
- rendezvous points: every collective instance on a communicator and every Send/Recv pair is one
  rendezvous whose members all write their GPU arrival time to a shared board. A collective ends
  on every member at (last arrival + transfer time); the transfer time is fixed by the plan so that
  all members compute the same end (a slow link lengthens every transfer that crosses it: Send/Recv
  between its ranks and every collective whose ring has them as neighbours).

The builder checks that every rendezvous is complete and that the schedules cannot deadlock, so a
bad layout fails here, not as a silent hang of N processes.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

LAYOUTS = ("ddp", "fsdp", "megatron")
MAX_RANKS = 512
DTYPE_BYTES = {"ncclInt8": 1, "ncclUint8": 1, "ncclFloat16": 2, "ncclBfloat16": 2, "ncclFloat32": 4, "ncclInt64": 8}
COLLECTIVES = ("AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Reduce")
P2P_FUNCS = ("Send", "Recv")
SETUP_STEP = -1
PHASES = ("forward", "backward", "optimizer")  # compute phase labels a fault can single out


# ----------------------------------------------------------------------------- faults


@dataclass(frozen=True)
class Straggler:
    """Rank ``rank`` computes ``slow_pct`` percent slower from step ``from_step`` on.

    ``phase`` ("forward", "backward", "optimizer") limits it to that kind of compute phase; empty: all.
    """

    rank: int
    slow_pct: float
    from_step: int = 0
    phase: str = ""
    type: Literal["straggler"] = "straggler"


@dataclass(frozen=True)
class Late:
    """Rank ``rank`` is ``delay_ms`` late every step from ``from_step`` on: its first compute phase
    labelled ``phase`` in each step starts that much later (a host-side stall: data loading, garbage
    collection, a sleep before backward)."""

    rank: int
    delay_ms: float
    from_step: int = 0
    phase: str = "backward"
    type: Literal["late"] = "late"


@dataclass(frozen=True)
class Hang:
    """Rank ``rank`` stops before launch ``op_index`` of step ``step`` and never issues it."""

    rank: int
    step: int
    op_index: int = 0
    type: Literal["hang"] = "hang"


@dataclass(frozen=True)
class Crash:
    """Rank ``rank`` exits abruptly (``os._exit(exit_code)``) before launch ``op_index`` of ``step``."""

    rank: int
    step: int
    op_index: int = 0
    exit_code: int = 1
    type: Literal["crash"] = "crash"


@dataclass(frozen=True)
class Pause:
    """Every rank pauses ``seconds`` outside NCCL before launch ``op_index`` of step ``step`` (a checkpoint,
    an evaluation, a slow data loader): nothing is in flight meanwhile, and the job goes on afterwards."""

    step: int
    seconds: float
    op_index: int = 0
    type: Literal["pause"] = "pause"


@dataclass(frozen=True)
class SlowLink:
    """The link between global ranks ``ranks[0]`` and ``ranks[1]`` (a bad NIC or cable) is ``factor`` times
    slower: so is every transfer that crosses it, Send/Recv between the two and every collective whose
    ring has them as neighbours (see ``link_pairs`` and ``_transfer_ns``)."""

    ranks: tuple[int, int]
    factor: float = 5.0
    type: Literal["slow_link"] = "slow_link"


Fault = Straggler | Late | Hang | Crash | SlowLink | Pause


# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class SimulationConfig:
    """Everything that determines a simulated job. Validated by ``validate``; frozen so it can be shared."""

    layout: str = "ddp"
    ranks: int = 4
    nodes: int = 1
    tp: int = 1
    pp: int = 1
    dp: int = 0  # 0: ranks / (tp * pp)
    steps: int = 5
    step_ms: float = 20.0
    jitter: float = 0.05
    seed: int = 0
    buckets: int = 4  # ddp gradient buckets
    layers: int = 4  # fsdp layers; megatron layers per pipeline stage
    micro_batches: int = 0  # megatron; 0: 2 * pp
    abi: int = 5
    comm_names: bool = True  # False: NCCL gives commName NULL (as PyTorch 2.11 does)
    intra_node_gbps: float = 100.0
    inter_node_gbps: float = 20.0
    faults: tuple[Fault, ...] = ()
    hang_timeout_s: float = 0.0  # 0: derived from the step time
    on_hang: Literal["abort", "kill"] = "abort"

    @property
    def data_parallel(self) -> int:
        """The data-parallel size (megatron), or the world size for ddp/fsdp."""
        if self.layout != "megatron":
            return self.ranks
        return self.dp or self.ranks // max(1, self.tp * self.pp)

    @property
    def ranks_per_node(self) -> int:
        """Ranks on each simulated node."""
        return self.ranks // self.nodes

    @property
    def n_micro_batches(self) -> int:
        """Micro-batches per step (megatron)."""
        return self.micro_batches or 2 * self.pp

    def effective_hang_timeout_s(self) -> float:
        """Seconds without progress on any rank after which the run is ended."""
        if self.hang_timeout_s > 0:
            return self.hang_timeout_s
        slowest = max([f.slow_pct for f in self.faults if isinstance(f, Straggler)], default=0.0)
        paused = max([f.seconds for f in self.faults if isinstance(f, Pause)], default=0.0)
        late = max([f.delay_ms for f in self.faults if isinstance(f, Late)], default=0.0)
        slowest_step_ms = self.step_ms * (1 + self.jitter) * (1 + slowest / 100.0) + late
        return max(2.0, 4.0 * slowest_step_ms / 1000.0, paused + 5.0)


def validate(config: SimulationConfig) -> None:
    """Raise ValueError with a clear message when ``config`` cannot describe a job."""
    if config.layout not in LAYOUTS:
        raise ValueError(f"unknown layout {config.layout!r} (choose from {', '.join(LAYOUTS)})")
    if not 1 <= config.ranks <= MAX_RANKS:
        raise ValueError(f"ranks must be between 1 and {MAX_RANKS}, got {config.ranks}")
    if config.nodes < 1 or config.ranks % config.nodes:
        raise ValueError(f"{config.ranks} ranks cannot be split evenly over {config.nodes} nodes")
    if not 1 <= config.steps <= 100_000:
        raise ValueError(f"steps must be between 1 and 100000, got {config.steps}")
    if not 0 < config.step_ms <= 600_000:
        raise ValueError(f"step time must be in (0, 600000] ms, got {config.step_ms}")
    if not 0 <= config.jitter < 1:
        raise ValueError(f"jitter is a fraction in [0, 1), got {config.jitter}")
    if not 1 <= config.buckets <= 1024 or not 1 <= config.layers <= 1024:
        raise ValueError("buckets and layers must be between 1 and 1024")
    if config.abi not in (4, 5):
        raise ValueError(f"profiler ABI must be 4 or 5, got {config.abi}")
    if config.on_hang not in ("abort", "kill"):
        raise ValueError(f"on_hang must be 'abort' or 'kill', got {config.on_hang!r}")
    if config.intra_node_gbps <= 0 or config.inter_node_gbps <= 0:
        raise ValueError("link bandwidths must be positive")
    if config.hang_timeout_s < 0:
        raise ValueError("hang timeout must not be negative")
    if config.layout == "megatron":
        for name in ("tp", "pp"):
            if getattr(config, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if config.dp < 0:
            raise ValueError("dp must not be negative")
        if config.tp * config.pp * config.data_parallel != config.ranks:
            raise ValueError(
                f"tp x pp x dp = {config.tp} x {config.pp} x {config.data_parallel} does not equal {config.ranks} ranks"
            )
        if not 1 <= config.n_micro_batches <= 1024:
            raise ValueError("micro-batches must be between 1 and 1024")
    elif config.tp != 1 or config.pp != 1 or config.dp not in (0, config.ranks):
        raise ValueError(f"--tp/--pp/--dp apply to the megatron layout only, not {config.layout}")
    for fault in config.faults:
        _validate_fault(config, fault)
    stoppers = [f for f in config.faults if isinstance(f, Hang | Crash)]
    if len({f.rank for f in stoppers}) != len(stoppers):
        raise ValueError("a rank can hang or crash only once")


def _validate_fault(config: SimulationConfig, fault: Fault) -> None:
    if isinstance(fault, Pause):
        if not 0 <= fault.step < config.steps:
            raise ValueError(f"pause: step {fault.step} is not in 0..{config.steps - 1}")
        if not 0 < fault.seconds <= 3600 or fault.op_index < 0:
            raise ValueError("pause: seconds must be in (0, 3600] and the op index not negative")
        return
    ranks = fault.ranks if isinstance(fault, SlowLink) else (fault.rank,)
    for rank in ranks:
        if not 0 <= rank < config.ranks:
            raise ValueError(f"{fault.type}: rank {rank} is not in 0..{config.ranks - 1}")
    if isinstance(fault, Straggler | Late):
        if isinstance(fault, Straggler) and not 0 < fault.slow_pct <= 10_000:
            raise ValueError(f"straggler: slow percentage must be in (0, 10000], got {fault.slow_pct}")
        if isinstance(fault, Late) and not 0 < fault.delay_ms <= 600_000:
            raise ValueError(f"late: delay must be in (0, 600000] ms, got {fault.delay_ms}")
        if not 0 <= fault.from_step < config.steps:
            raise ValueError(f"{fault.type}: from-step {fault.from_step} is not in 0..{config.steps - 1}")
        if fault.phase not in (*PHASES, "") or (isinstance(fault, Late) and not fault.phase):
            raise ValueError(f"{fault.type}: phase must be one of {', '.join(PHASES)}, got {fault.phase!r}")
    elif isinstance(fault, Hang | Crash):
        if not 0 <= fault.step < config.steps:
            raise ValueError(f"{fault.type}: step {fault.step} is not in 0..{config.steps - 1}")
        if fault.op_index < 0:
            raise ValueError(f"{fault.type}: op index must not be negative")
        if isinstance(fault, Crash) and not 1 <= fault.exit_code <= 255:
            raise ValueError("crash: exit code must be in 1..255")
    elif isinstance(fault, SlowLink):
        if fault.ranks[0] == fault.ranks[1]:
            raise ValueError("slow link: the two ranks must differ")
        if not 1 < fault.factor <= 1000:
            raise ValueError(f"slow link: factor must be in (1, 1000], got {fault.factor}")


# ----------------------------------------------------------------------------- plan objects


@dataclass(frozen=True)
class Communicator:
    """One NCCL communicator: members (global ranks, in comm-rank order), hash, simulated node count."""

    index: int
    name: str
    kind: str
    ranks: tuple[int, ...]
    comm_hash: int
    nnodes: int

    @property
    def nranks(self) -> int:
        """Number of members."""
        return len(self.ranks)

    def comm_rank(self, global_rank: int) -> int:
        """The member's rank within this communicator."""
        return self.ranks.index(global_rank)


@dataclass(frozen=True)
class Op:
    """One NCCL operation as the application calls it (user count and dtype)."""

    func: str
    comm: int
    count: int
    dtype: str
    peer: int = -1  # P2P peer or collective root, as a rank of the communicator; -1 when none
    role: str = ""
    rendezvous: int = -1  # -1: nothing to wait for (one-rank communicator)

    @property
    def is_p2p(self) -> bool:
        """True for Send/Recv."""
        return self.func in P2P_FUNCS

    @property
    def bytes(self) -> int:
        """Payload bytes this rank contributes (count x element size)."""
        return self.count * DTYPE_BYTES[self.dtype]

    def coll_count_dtype(self) -> tuple[int, str]:
        """Count and datatype as the Coll event reports them: AllGather and Broadcast in bytes of ncclInt8."""
        if self.func in ("AllGather", "Broadcast"):
            return self.bytes, "ncclInt8"
        return self.count, self.dtype


@dataclass(frozen=True)
class Launch:
    """The operations issued between one ncclGroupStart/ncclGroupEnd (one GroupApi event)."""

    ops: tuple[Op, ...]


@dataclass(frozen=True)
class Compute:
    """A CPU phase of ``weight`` x the step time, started once ``after`` launches of this rank completed."""

    weight: float
    after: int = 0
    label: str = "compute"


Action = Launch | Compute


@dataclass(frozen=True)
class RankSchedule:
    """What one rank does: a setup phase, then one action list per step."""

    rank: int
    setup: tuple[Action, ...]
    steps: tuple[tuple[Action, ...], ...]

    def launches_in_step(self, step: int) -> int:
        """How many launches step ``step`` has."""
        return sum(isinstance(a, Launch) for a in self.steps[step])


@dataclass(frozen=True)
class Plan:
    """A built, checked simulation plan (see the module docstring)."""

    config: SimulationConfig
    communicators: tuple[Communicator, ...]
    schedules: tuple[RankSchedule, ...]
    rendezvous_members: tuple[tuple[int, ...], ...]
    rendezvous_offsets: np.ndarray  # first board slot of each rendezvous; last entry = total slots
    transfer_ns: np.ndarray  # per rendezvous
    node_of_rank: tuple[int, ...]
    coordinates: tuple[dict[str, int], ...] = field(default_factory=tuple)
    rendezvous_ops: tuple[Op, ...] = ()  # per rendezvous, the operation as its first member issues it

    def communicators_of(self, rank: int) -> list[Communicator]:
        """The communicators ``rank`` belongs to, in creation order."""
        return [c for c in self.communicators if rank in c.ranks]


# ----------------------------------------------------------------------------- communicators


def comm_hash(layout: str, name: str, ranks: tuple[int, ...]) -> int:
    """A stable 64-bit commHash for a group: the same on every member, different between groups."""
    digest = hashlib.blake2b(f"{layout}|{name}|{','.join(map(str, ranks))}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") or 1


def _communicators(config: SimulationConfig, node_of_rank: tuple[int, ...]) -> tuple[Communicator, ...]:
    groups: list[tuple[str, str, tuple[int, ...]]] = [("world", "world", tuple(range(config.ranks)))]
    if config.layout == "megatron":
        tp, pp, dp = config.tp, config.pp, config.data_parallel

        def rank_of(t: int, d: int, p: int) -> int:
            return t + tp * (d + dp * p)

        tp_groups = [tuple(rank_of(t, d, p) for t in range(tp)) for p in range(pp) for d in range(dp)]
        pp_groups = [tuple(rank_of(t, d, p) for p in range(pp)) for t in range(tp) for d in range(dp)]
        dp_groups = [tuple(rank_of(t, d, p) for d in range(dp)) for p in range(pp) for t in range(tp)]
        mp_groups = [tuple(sorted(rank_of(t, d, p) for p in range(pp) for t in range(tp))) for d in range(dp)]
        for kind, members_list in (("tp", tp_groups), ("pp", pp_groups), ("dp", dp_groups), ("mp", mp_groups)):
            groups += [(kind, f"{kind}{i}", members) for i, members in enumerate(members_list)]
    return tuple(
        Communicator(
            index=i,
            name=name,
            kind=kind,
            ranks=members,
            comm_hash=comm_hash(config.layout, name, members),
            nnodes=len({node_of_rank[r] for r in members}),
        )
        for i, (kind, name, members) in enumerate(groups)
    )


# ----------------------------------------------------------------------------- layouts


class _RankBuilder:
    """Collects one rank's actions; tracks the launch count so compute phases can wait on launches."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.launches = 0

    def launch(self, *ops: Op) -> int:
        """Append one launch; returns how many launches must complete for it to be done."""
        if ops:
            self.actions.append(Launch(tuple(ops)))
            self.launches += 1
        return self.launches

    def compute(self, weight: float, after: int = 0, label: str = "compute") -> None:
        """Append a compute phase that waits for the first ``after`` launches."""
        self.actions.append(Compute(weight, after, label))

    def take(self) -> tuple[Action, ...]:
        """The actions collected since the last take."""
        actions, self.actions = tuple(self.actions), []
        return actions


# Sizes are those of a small model; they set transfer times, which stay well below step times.
_DDP_PARAMS = 24 * 1024 * 1024  # fp32 elements (96 MB of gradients per step)
_FSDP_LAYER_PARAMS = 8 * 1024 * 1024  # bf16 elements per layer
_ACTIVATION = 512 * 1024  # bf16 elements: sequence 512 x hidden 1024, micro-batch 1
_STAGE_PARAMS = 16 * 1024 * 1024  # bf16 parameters of one pipeline stage (per tp rank)


def _ddp(config: SimulationConfig, rank: int, b: _RankBuilder) -> tuple[tuple[Action, ...], list[tuple[Action, ...]]]:
    world = 0
    b.launch(Op("Broadcast", world, _DDP_PARAMS, "ncclFloat32", peer=0, role="param_broadcast"))
    b.compute(0.0, b.launches, "setup_sync")
    setup = b.take()
    steps = []
    bucket = _DDP_PARAMS // config.buckets
    for _ in range(config.steps):
        b.compute(0.35, label="forward")
        for _bucket in range(config.buckets):
            b.compute(0.5 / config.buckets, label="backward")
            b.launch(Op("AllReduce", world, bucket, "ncclFloat32", role="grad_bucket"))
        b.compute(0.15, b.launches, "optimizer")
        done = b.launch(Op("AllReduce", world, 1, "ncclFloat32", role="loss"))
        b.compute(0.0, done, "loss_item")
        steps.append(b.take())
    return setup, steps


def _fsdp(config: SimulationConfig, rank: int, b: _RankBuilder) -> tuple[tuple[Action, ...], list[tuple[Action, ...]]]:
    world, layers = 0, config.layers
    shard = _FSDP_LAYER_PARAMS // config.ranks
    steps = []
    for _ in range(config.steps):
        # Forward: all-gather layer l+1 (prefetch) before computing layer l, which needs layer l's gather.
        gathered = [b.launch(Op("AllGather", world, shard, "ncclBfloat16", role="fsdp_allgather_fwd"))]
        for layer in range(layers):
            if layer + 1 < layers:
                gathered.append(b.launch(Op("AllGather", world, shard, "ncclBfloat16", role="fsdp_allgather_fwd")))
            b.compute(0.35 / layers, gathered[layer], "forward")
        # Backward: re-gather (resharded after forward), compute, reduce-scatter the gradient shard.
        regathered = {layers - 1: b.launch(Op("AllGather", world, shard, "ncclBfloat16", role="fsdp_allgather_bwd"))}
        for layer in reversed(range(layers)):
            if layer > 0:
                regathered[layer - 1] = b.launch(
                    Op("AllGather", world, shard, "ncclBfloat16", role="fsdp_allgather_bwd")
                )
            b.compute(0.5 / layers, regathered[layer], "backward")
            b.launch(Op("ReduceScatter", world, shard, "ncclFloat32", role="fsdp_reduce_scatter"))
        b.compute(0.15, b.launches, "optimizer")
        done = b.launch(Op("AllReduce", world, 1, "ncclFloat32", role="loss"))
        b.compute(0.0, done, "loss_item")
        steps.append(b.take())
    return (), steps


def _megatron(
    config: SimulationConfig, rank: int, b: _RankBuilder, comms: tuple[Communicator, ...]
) -> tuple[tuple[Action, ...], list[tuple[Action, ...]]]:
    tp, pp, dp, micro = config.tp, config.pp, config.data_parallel, config.n_micro_batches
    p = rank // (tp * dp)  # pipeline stage

    def member(kind: str) -> Communicator:
        return next(c for c in comms if c.kind == kind and rank in c.ranks)

    tp_comm, pp_comm, dp_comm, mp_comm = member("tp"), member("pp"), member("dp"), member("mp")
    first, last = p == 0, p == pp - 1
    per_pass = 1.0 / (3 * micro * config.layers)  # forward is a third, backward two thirds of the compute

    def layer_pass(weight: float, label: str) -> None:
        # Megatron's row/column-parallel layers: two TP all-reduces per layer and pass; none when tp == 1.
        for _ in range(config.layers):
            if tp == 1:
                b.compute(weight, b.launches, label)
                continue
            for _half in range(2):
                b.compute(weight / 2, b.launches, label)
                b.launch(Op("AllReduce", tp_comm.index, _ACTIVATION, "ncclBfloat16", role=f"tp_{label}"))

    def p2p(func: str, to_next: bool, role: str) -> Op:
        peer = pp_comm.comm_rank(rank) + (1 if to_next else -1)
        return Op(func, pp_comm.index, _ACTIVATION, "ncclBfloat16", peer=peer, role=role)

    def recv_forward() -> None:
        if not first:
            b.launch(p2p("Recv", False, "pp_recv_forward"))

    def send_forward() -> None:
        if not last:
            b.launch(p2p("Send", True, "pp_send_forward"))

    def recv_backward() -> None:
        if not last:
            b.launch(p2p("Recv", True, "pp_recv_backward"))

    def send_backward() -> None:
        if not first:
            b.launch(p2p("Send", False, "pp_send_backward"))

    def send_forward_recv_backward() -> None:
        if not last:
            b.launch(p2p("Send", True, "pp_send_forward"), p2p("Recv", True, "pp_recv_backward"))

    def send_backward_recv_forward() -> None:
        if not first:
            b.launch(p2p("Send", False, "pp_send_backward"), p2p("Recv", False, "pp_recv_forward"))

    steps = []
    shard = _STAGE_PARAMS // dp
    for _ in range(config.steps):
        # Distributed optimizer with overlapped parameter gather: the all-gather of the parameters
        # updated by the previous step is issued as the step begins (the forward needs it).
        b.launch(Op("AllGather", dp_comm.index, shard, "ncclBfloat16", role="dp_param_allgather"))
        # One-forward-one-backward pipeline schedule (Megatron's non-interleaved 1F1B).
        warmup = min(pp - p - 1, micro)
        remaining = micro - warmup
        for _mb in range(warmup):
            recv_forward()
            layer_pass(per_pass, "forward")
            send_forward()
        if remaining:
            recv_forward()
        for i in range(remaining):
            layer_pass(per_pass, "forward")
            send_forward_recv_backward()
            layer_pass(2 * per_pass, "backward")
            if i == remaining - 1:
                send_backward()
            else:
                send_backward_recv_forward()
        for _mb in range(warmup):
            recv_backward()
            layer_pass(2 * per_pass, "backward")
            send_backward()
        # Distributed optimizer: reduce-scatter gradients, grad-norm all-reduce, step.
        b.launch(Op("ReduceScatter", dp_comm.index, shard, "ncclFloat32", role="dp_grad_reduce_scatter"))
        b.launch(Op("AllReduce", mp_comm.index, 1, "ncclFloat32", role="grad_norm"))
        b.compute(0.1, b.launches, "optimizer")
        if last:
            b.launch(Op("AllReduce", dp_comm.index, 1, "ncclFloat32", role="loss"))
        b.compute(0.0, b.launches, "loss_item")
        steps.append(b.take())
    return (), steps


def _normalised(actions: tuple[Action, ...]) -> tuple[Action, ...]:
    total = sum(a.weight for a in actions if isinstance(a, Compute))
    if total <= 0:
        return actions
    return tuple(Compute(a.weight / total, a.after, a.label) if isinstance(a, Compute) else a for a in actions)


# ----------------------------------------------------------------------------- rendezvous and checks


def _assign_rendezvous(
    schedules: list[RankSchedule], comms: tuple[Communicator, ...]
) -> tuple[list[RankSchedule], list[tuple[int, ...]], list[Op]]:
    keys: dict[tuple, int] = {}
    members: list[tuple[int, ...]] = []
    first_op: list[Op] = []
    filled: list[set[int]] = []

    def rendezvous_of(rank: int, op: Op, counters: defaultdict) -> int:
        comm = comms[op.comm]
        if comm.nranks == 1:
            return -1
        if op.is_p2p:
            peer = comm.ranks[op.peer]
            src, dst = (rank, peer) if op.func == "Send" else (peer, rank)
            counters[(op.comm, op.func, peer)] += 1
            key: tuple = ("p2p", op.comm, src, dst, counters[(op.comm, op.func, peer)])
            who: tuple[int, ...] = (src, dst)
            slot = 0 if op.func == "Send" else 1
        else:
            counters[(op.comm, "coll")] += 1
            key = ("coll", op.comm, counters[(op.comm, "coll")])
            who, slot = comm.ranks, comm.comm_rank(rank)
        if key not in keys:
            keys[key] = len(members)
            members.append(who)
            first_op.append(op)
            filled.append(set())
        index = keys[key]
        if not op.is_p2p and (first_op[index].func, first_op[index].count) != (op.func, op.count):
            raise ValueError(f"layout bug: rank {rank} issues {op.func} where others issue {first_op[index].func}")
        if slot in filled[index]:
            raise ValueError(f"layout bug: rendezvous {key} joined twice by slot {slot}")
        filled[index].add(slot)
        return index

    result = []
    for schedule in schedules:
        counters: defaultdict = defaultdict(int)

        def assign(actions: tuple[Action, ...], rank: int = schedule.rank, counters: defaultdict = counters):
            out: list[Action] = []
            for action in actions:
                if isinstance(action, Launch):
                    # Positional construction: dataclasses.replace is slow for hundreds of thousands of ops.
                    ops = tuple(
                        Op(o.func, o.comm, o.count, o.dtype, o.peer, o.role, rendezvous_of(rank, o, counters))
                        for o in action.ops
                    )
                    out.append(Launch(ops))
                else:
                    out.append(action)
            return tuple(out)

        result.append(
            RankSchedule(schedule.rank, assign(schedule.setup), tuple(assign(step) for step in schedule.steps))
        )
    for index, who in enumerate(members):
        if len(filled[index]) != len(who):
            raise ValueError(f"layout bug: rendezvous {index} ({first_op[index].func}) is never completed")
    return result, members, first_op


def check_deadlock_free(schedules: list[RankSchedule], members: list[tuple[int, ...]]) -> None:
    """Raise ValueError when the schedules can block forever (each GPU runs its launches in order).

    A launch posts its arrival to all its rendezvous at once and completes when every member of
    each has arrived; a compute phase blocks its CPU until ``after`` launches completed.
    """
    programs = [[a for a in s.setup] + [a for step in s.steps for a in step] for s in schedules]
    cpu = [0] * len(programs)  # next action index
    queued: list[list[Launch]] = [[] for _ in programs]
    completed = [0] * len(programs)
    arrived = [0] * len(members)
    posted = [False] * len(programs)
    progress = True
    while progress:
        progress = False
        for r, program in enumerate(programs):
            while cpu[r] < len(program):
                action = program[cpu[r]]
                if isinstance(action, Compute) and completed[r] < action.after:
                    break
                if isinstance(action, Launch):
                    queued[r].append(action)
                cpu[r] += 1
                progress = True
            while queued[r]:
                head = queued[r][0]
                if not posted[r]:
                    for op in head.ops:
                        if op.rendezvous >= 0:
                            arrived[op.rendezvous] += 1
                    posted[r] = True
                    progress = True
                if any(op.rendezvous >= 0 and arrived[op.rendezvous] < len(members[op.rendezvous]) for op in head.ops):
                    break
                queued[r].pop(0)
                posted[r] = False
                completed[r] += 1
                progress = True
    stuck = [r for r, program in enumerate(programs) if cpu[r] < len(program) or queued[r]]
    if stuck:
        raise ValueError(f"layout bug: schedules deadlock (ranks {stuck[:8]} never finish)")


def link_pairs(op: Op, members: tuple[int, ...]) -> set[frozenset[int]]:
    """The links (pairs of global ranks) an operation's data crosses; ``members`` as its rendezvous has them.

    Send/Recv: the pair. Collectives run on a ring in comm-rank order (NCCL's "Ring" algorithm, which
    the plugin is told): AllReduce, AllGather and ReduceScatter use every hop of the closed ring;
    Broadcast pipelines a chain that starts at the root, Reduce one that ends at it, so each leaves out
    the one hop that would return to where it started.
    """
    n = len(members)
    if op.is_p2p:
        return {frozenset(members)}
    if n < 2:
        return set()
    root = max(op.peer, 0)
    if op.func == "Broadcast":
        hops = [(root + k) % n for k in range(n - 1)]
    elif op.func == "Reduce":
        hops = [(root + k) % n for k in range(1, n)]
    else:
        hops = list(range(n))
    return {frozenset((members[i], members[(i + 1) % n])) for i in hops}


def _transfer_ns(config: SimulationConfig, op: Op, members: tuple[int, ...], nodes: tuple[int, ...]) -> int:
    n = len(members)
    payload = op.bytes
    if op.func == "AllReduce":
        wire = 2 * (n - 1) / n * payload
    elif op.func in ("AllGather", "ReduceScatter"):
        wire = (n - 1) * payload  # the per-rank count times (n - 1) crosses each link
    else:
        wire = payload
    spans_nodes = len({nodes[r] for r in members}) > 1
    gbps = config.inter_node_gbps if spans_nodes else config.intra_node_gbps
    ns = 8_000 + wire / gbps  # bytes / (GB/s) is ns; plus a fixed launch latency
    # A slow link: the alpha-beta cost of a ring collective is (steps) x (one step), and in each step
    # every hop carries one chunk at once, so a step lasts as long as its slowest hop. A link F times
    # slower (latency and bandwidth) makes every step, hence the whole transfer, F times longer; of
    # several slow links on one ring the slowest sets the pace. Send/Recv cross their one link.
    links = [f for f in config.faults if isinstance(f, SlowLink)]
    if links:
        crossed = link_pairs(op, members)
        ns *= max([f.factor for f in links if frozenset(f.ranks) in crossed], default=1.0)
    return int(ns)


def build_plan(config: SimulationConfig, *, check: bool = True) -> Plan:
    """Validate ``config`` and build its plan (deterministic: every process gets the same one).

    ``check=False`` skips the deadlock check, for rank processes whose parent already checked.
    """
    validate(config)
    node_of_rank = tuple(r // config.ranks_per_node for r in range(config.ranks))
    comms = _communicators(config, node_of_rank)
    schedules = []
    coordinates = []
    for rank in range(config.ranks):
        builder = _RankBuilder()
        if config.layout == "ddp":
            setup, steps = _ddp(config, rank, builder)
        elif config.layout == "fsdp":
            setup, steps = _fsdp(config, rank, builder)
        else:
            setup, steps = _megatron(config, rank, builder, comms)
        if config.layout == "megatron":
            tp, dp = config.tp, config.data_parallel
            coordinates.append({"tp": rank % tp, "dp": (rank // tp) % dp, "pp": rank // (tp * dp)})
        else:
            coordinates.append({"dp": rank})
        schedules.append(RankSchedule(rank, setup, tuple(_normalised(s) for s in steps)))
    schedules, members, first_op = _assign_rendezvous(schedules, comms)
    if check:
        check_deadlock_free(schedules, members)
    for fault in config.faults:
        if isinstance(fault, Hang | Crash):
            available = schedules[fault.rank].launches_in_step(fault.step)
            if fault.op_index >= available:
                raise ValueError(
                    f"{fault.type}: rank {fault.rank} has {available} launches in step {fault.step}; "
                    f"op index {fault.op_index} is out of range"
                )
        if isinstance(fault, SlowLink) and not any(
            frozenset(fault.ranks) in link_pairs(op, m) for op, m in zip(first_op, members, strict=True)
        ):
            raise ValueError(
                f"slow link: no traffic crosses ranks {fault.ranks[0]} and {fault.ranks[1]} (no Send/Recv between "
                "them, and no collective's ring has them as neighbours)"
            )
    offsets = np.zeros(len(members) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(m) for m in members])
    transfer = np.array(
        [_transfer_ns(config, op, m, node_of_rank) for op, m in zip(first_op, members, strict=True)], dtype=np.float64
    )
    # Small deterministic variation, identical on every member (all members build the same plan).
    transfer *= 1 + np.random.default_rng([config.seed, 7]).uniform(-0.05, 0.05, size=len(transfer))
    return Plan(
        config=config,
        communicators=comms,
        schedules=tuple(schedules),
        rendezvous_members=tuple(members),
        rendezvous_offsets=offsets,
        transfer_ns=transfer.astype(np.int64),
        node_of_rank=node_of_rank,
        coordinates=tuple(coordinates),
        rendezvous_ops=tuple(first_op),
    )


def compute_durations(config: SimulationConfig, rank: int, steps: tuple[tuple[Action, ...], ...]) -> list[list[float]]:
    """Per step, the duration in ms of each compute phase (deterministic in seed and rank)."""
    rng = np.random.default_rng([config.seed, 1, rank])
    slow = [f for f in config.faults if isinstance(f, Straggler) and f.rank == rank]
    late = [f for f in config.faults if isinstance(f, Late) and f.rank == rank]
    out = []
    for step, actions in enumerate(steps):
        computes = [a for a in actions if isinstance(a, Compute)]
        weights = np.array([a.weight for a in computes], dtype=float)
        labels = np.array([a.label for a in computes], dtype=object)
        factor = np.ones(len(computes))
        for f in slow:
            if step >= f.from_step:
                factor += (f.slow_pct / 100.0) * ((labels == f.phase) if f.phase else 1.0)
        noise = 1.0 + rng.uniform(-config.jitter, config.jitter, size=len(weights))
        durations = weights * config.step_ms * factor * noise
        for f in late:
            first = np.flatnonzero(labels == f.phase)
            if step >= f.from_step and first.size:
                durations[first[0]] += f.delay_ms
        out.append(list(durations))
    return out


_FAULT_TYPES = {cls.type: cls for cls in (Straggler, Late, Hang, Crash, SlowLink, Pause)}  # type: ignore[attr-defined]


def config_to_dict(config: SimulationConfig) -> dict:
    """``config`` as plain JSON-able data (faults carry their ``type``)."""
    data = dataclasses.asdict(config)
    data["faults"] = [dataclasses.asdict(f) for f in config.faults]
    for fault in data["faults"]:
        if "ranks" in fault:
            fault["ranks"] = list(fault["ranks"])
    return data


def config_from_dict(data: dict) -> SimulationConfig:
    """The inverse of ``config_to_dict``; raises ValueError on unknown fields or fault types."""
    if not isinstance(data, dict):
        raise ValueError("a simulation configuration must be a JSON object")
    data = dict(data)
    faults = []
    raw_faults = data.pop("faults", [])
    if not isinstance(raw_faults, list) or not all(isinstance(f, dict) for f in raw_faults):
        raise ValueError("faults must be a list of objects")
    for fault in raw_faults:
        fault = dict(fault)
        kind = _FAULT_TYPES.get(fault.get("type", ""))
        if kind is None:
            raise ValueError(f"unknown fault type {fault.get('type')!r}")
        if not isinstance(fault.get("phase", ""), str):
            raise ValueError(f"{kind.type} fault: phase must be a string")
        numbers = [v for k, v in fault.items() if k not in ("type", "ranks", "phase")]
        if "ranks" in fault:
            if not isinstance(fault["ranks"], list) or len(fault["ranks"]) != 2:
                raise ValueError("a slow link's ranks are a list of two ranks")
            numbers += fault["ranks"]
            fault["ranks"] = tuple(fault["ranks"])
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in numbers):
            raise ValueError(f"{kind.type} fault fields must be numbers")
        integers = [fault.get(f.name, 0) for f in dataclasses.fields(kind) if f.type == "int"]
        if not all(isinstance(v, int) for v in integers) or not all(isinstance(r, int) for r in fault.get("ranks", ())):
            raise ValueError(f"{kind.type} fault: ranks, steps and indices must be integers")
        try:
            faults.append(kind(**fault))
        except TypeError as error:
            raise ValueError(f"bad {kind.type} fault: {error}") from None
    defaults = SimulationConfig()
    known = {f.name for f in dataclasses.fields(SimulationConfig)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"unknown configuration fields: {', '.join(sorted(unknown))}")
    for name, value in data.items():
        expected = type(getattr(defaults, name))
        ok = isinstance(value, expected) and not (expected is int and isinstance(value, bool))
        if expected is float:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok:
            raise ValueError(f"configuration field {name!r} must be {expected.__name__}, got {value!r:.40}")
    return SimulationConfig(**data, faults=tuple(faults))
