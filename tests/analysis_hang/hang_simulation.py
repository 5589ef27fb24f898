"""A small job simulator for hang tests: Megatron-style TP x PP x DP programs run in lockstep.

Each rank runs a program of collective and P2P operations. An operation starts when the rank
reaches it and completes only when its partners reached the matching one (all members of a
collective at the same sequence with the same op/size/dtype; the peer's matching send/recv).
A rank told to hang stops before a given position (stuck in compute); a rank can be given a
different op at one position (a mismatch). The resulting operations table is what a profiler
would have seen; ``fr_style`` turns it into what a Flight Recorder dump holds (no times, every
recorded entry "scheduled", completed entries replaced by one progress watermark).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

import pyarrow as pa

from comminsight.evidence import PROGRESS_OP, conform


@dataclass(frozen=True)
class Op:
    comm: str
    op: str
    count: int = 1024
    dtype: str = "bfloat16"
    peer: int | None = None


@dataclass
class Layout:
    tp: int
    pp: int
    dp: int

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp, dp, pp) coordinates: rank = pp * (dp * tp) + dp * tp + tp (Megatron order)."""
        return rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp)

    def rank(self, tp: int, dp: int, pp: int) -> int:
        return pp * (self.dp * self.tp) + dp * self.tp + tp

    def comms(self) -> dict[str, tuple[str, list[int]]]:
        """Communicator id -> (Megatron description, member ranks)."""
        out: dict[str, tuple[str, list[int]]] = {}
        for pp in range(self.pp):
            for dp in range(self.dp):
                out[f"tp{pp}.{dp}"] = (
                    "TENSOR_MODEL_PARALLEL_GROUP",
                    [self.rank(t, dp, pp) for t in range(self.tp)],
                )
            for tp in range(self.tp):
                out[f"dp{pp}.{tp}"] = ("DATA_PARALLEL_GROUP", [self.rank(tp, d, pp) for d in range(self.dp)])
        for dp in range(self.dp):
            for tp in range(self.tp):
                out[f"pp{dp}.{tp}"] = (
                    "PIPELINE_MODEL_PARALLEL_GROUP",
                    [self.rank(tp, dp, p) for p in range(self.pp)],
                )
        return out

    def program(self, rank: int, steps: int = 3, microbatches: int = 2) -> list[Op]:
        tp, dp, pp = self.coords(rank)
        prev_rank = self.rank(tp, dp, pp - 1) if pp > 0 else None
        next_rank = self.rank(tp, dp, pp + 1) if pp < self.pp - 1 else None
        tp_comm, dp_comm, pp_comm = f"tp{pp}.{dp}", f"dp{pp}.{tp}", f"pp{dp}.{tp}"
        ops: list[Op] = []
        for _ in range(steps):
            for _ in range(microbatches):
                if prev_rank is not None:
                    ops.append(Op(pp_comm, "recv", 4096, peer=prev_rank))
                if self.tp > 1:
                    ops += [Op(tp_comm, "all_reduce", 8192), Op(tp_comm, "all_reduce", 8192)]
                if next_rank is not None:
                    ops.append(Op(pp_comm, "send", 4096, peer=next_rank))
            for _ in range(microbatches):
                if next_rank is not None:
                    ops.append(Op(pp_comm, "recv", 4096, peer=next_rank))
                if self.tp > 1:
                    ops += [Op(tp_comm, "all_reduce", 8192), Op(tp_comm, "all_reduce", 8192)]
                if prev_rank is not None:
                    ops.append(Op(pp_comm, "send", 4096, peer=prev_rank))
            if self.dp > 1:
                ops.append(Op(dp_comm, "all_reduce", 1 << 20, "float32"))
        return ops


def run(
    layout: Layout,
    programs: dict[int, list[Op]],
    hang_at: dict[int, int] | None = None,
) -> pa.Table:
    """Run ``programs`` in lockstep; ``hang_at`` = {rank: position it never reaches}. Returns the table."""
    hang_at = hang_at or {}
    comms = layout.comms()
    seq_counter: dict[tuple[int, str, str], int] = defaultdict(int)
    pair_counter: dict[tuple[int, int, int, str], int] = defaultdict(int)
    pos = dict.fromkeys(programs, 0)
    entered: dict[int, dict] = {}  # rank -> the op it is inside
    rows: list[dict] = []
    # Matching keys -> ranks that entered with that key (and their signature).
    waiting: dict[tuple, dict[int, tuple]] = defaultdict(dict)
    clock = 0

    def enter(rank: int) -> None:
        nonlocal clock
        op = programs[rank][pos[rank]]
        clock += 1
        is_p2p = op.op in ("send", "recv")
        kind = "p2p" if is_p2p else "comm"
        seq = seq_counter[(rank, op.comm, kind)]
        seq_counter[(rank, op.comm, kind)] += 1
        if is_p2p:
            src, dst = (rank, op.peer) if op.op == "send" else (op.peer, rank)
            n = pair_counter[(src, dst, rank, op.comm)]
            pair_counter[(src, dst, rank, op.comm)] += 1
            key = ("p2p", op.comm, src, dst, n)
            expected = 2
        else:
            key = ("coll", op.comm, seq)
            expected = len(comms[op.comm][1])
        desc, members = comms[op.comm]
        row = {
            "rank": rank,
            "comm_id": op.comm,
            "comm_name": op.comm,
            "comm_desc": desc,
            "comm_ranks": members,
            "comm_size": len(members),
            "comm_rank": members.index(rank),
            "op": op.op,
            "is_p2p": is_p2p,
            "seq": seq,
            "seq_kind": kind,
            "count": op.count,
            "bytes": op.count * 2,
            "dtype": op.dtype,
            "shape": f"[[{op.count}]]",
            "peer": op.peer,
            "state": "started",
            "enqueue_ns": clock * 1000,
            "start_ns": clock * 1000 + 10,
            "end_ns": None,
            "record_id": pos[rank],
            "source": "synthetic",
        }
        rows.append(row)
        entered[rank] = {"row": row, "key": key}
        signature = (op.op if not is_p2p else "p2p", op.count, op.dtype)
        waiting[key][rank] = signature
        group = waiting[key]
        if len(group) == expected and len(set(group.values())) == 1:
            clock += 1
            for member in list(group):
                done = entered.pop(member)
                done["row"]["state"] = "completed"
                done["row"]["end_ns"] = clock * 1000
                pos[member] += 1
            del waiting[key]

    progress = True
    while progress:
        progress = False
        for rank in sorted(programs):
            if rank in entered or pos[rank] >= len(programs[rank]) or hang_at.get(rank) == pos[rank]:
                continue
            enter(rank)
            progress = True
    return conform(pa.Table.from_pylist(rows))


def fr_style(table: pa.Table) -> pa.Table:
    """What Flight Recorder dumps would hold: pending entries 'scheduled' without times, plus watermarks."""
    rows = table.to_pylist()
    out = []
    last_done: dict[tuple, dict] = {}
    for row in rows:
        if row["state"] == "completed":
            key = (row["rank"], row["comm_id"], row["seq_kind"])
            if key not in last_done or row["seq"] > last_done[key]["seq"]:
                last_done[key] = row
            continue
        out.append(
            {**row, "state": "scheduled", "enqueue_ns": None, "start_ns": None, "end_ns": None, "source": "fr_sim"}
        )
    for row in last_done.values():
        out.append(
            {
                **row,
                "op": PROGRESS_OP,
                "state": "completed",
                "count": None,
                "bytes": None,
                "dtype": None,
                "shape": None,
                "peer": None,
                "enqueue_ns": None,
                "start_ns": None,
                "end_ns": None,
                "source": "fr_sim",
            }
        )
    return conform(pa.Table.from_pylist(out, schema=table.schema))


def programs_for(layout: Layout, steps: int = 3) -> dict[int, list[Op]]:
    return {r: layout.program(r, steps=steps) for r in range(layout.world)}


def swap_op(program: list[Op], position: int, **changes) -> list[Op]:
    """A copy of ``program`` with the op at ``position`` changed (for mismatches and deadlocks)."""
    copy = list(program)
    copy[position] = replace(copy[position], **changes)
    return copy
