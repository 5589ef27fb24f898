"""Hang and failure analysis: where did progress stop first, and which ranks should an engineer look at?

A pure function over the operations table (comminsight.evidence). This module classifies the stuck
groups and assembles the report; the polars passes that gather the evidence are in hang_evidence, the
wait-for graph and chain in hang_chain, the wording in hang_report. The
method, with its rules and limits, is written up in docs/analysis-hang.md. In short:

1. Every collective *stream* - (communicator, seq_kind[, op when seq_kind is "func"]) - is
   reduced per member rank to: the highest sequence it entered, its completion watermark (the
   highest sequence it reported completed; completion is in order within a stream) and its
   lowest pending sequence. Members come from the communicator's member list when a source
   gives it, else from the ranks seen in it; a member with no rows has entered nothing.
2. A stream is stuck when some member has a pending operation. Its blocking sequence is the
   lowest one some member never entered (those members are *missing*); when every member
   entered everything, it is the lowest sequence not completed by every member.
3. P2P operations are matched per (communicator, sender, receiver) by counting pending sends
   against pending receives; the side with nothing to match waits on the other.
4. Waiting ranks point at the ranks they wait for; the ranks where progress stopped first are
   the sink components of that graph (a rank that waits on nobody, or a cycle such as a P2P
   deadlock). Ranks whose completions lag operations their peers completed (their GPU stopped)
   and the minority side of an op/size/dtype mismatch are root causes too.
5. Program order: each rank's first pending operation (by enqueue time, else record id). Inside
   a matched P2P pair or a collective everyone entered, a member still busy with an earlier
   operation is waited on by the others; a rank missing from a collective because it is blocked
   in an earlier operation waits on whoever blocks that one. Such ranks are waiters, not causes.

Only sequence counts are needed: sources without timing (Flight Recorder dumps with every entry
"scheduled") are analysed the same way; timing, when present, orders ranks by last progress.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import polars as pl
import pyarrow as pa

from comminsight.analysis import hang_evidence as gather
from comminsight.analysis.hang_chain import MAX_LISTED, blocked_earlier, dependency_chain, sink_components, wait_paths
from comminsight.analysis.hang_report import summary_sentence
from comminsight.importers.columns import paused_gc


def analyze_hang(table: pa.Table | pl.DataFrame, *, silence_s: float = 60.0) -> dict[str, Any]:
    """Analyse an operations table for a hang; returns a JSON-ready report.

    Keys: ``verdict`` ("hang", "no_hang", "insufficient_evidence"), ``root_cause_ranks`` (ranks
    to look at first, most likely first), ``stuck_groups`` (per stuck communicator: group_id,
    group_desc, op, seq, shape, dtype, entered_ranks, missing_ranks, plus kind, waiting_ranks and
    lagging_ranks), ``chain`` (from the root-cause ranks outwards: who they block, where),
    ``mismatches``, ``failures`` (ranks without evidence, ranks that stopped reporting, abandoned
    operations, ranks whose completions stalled), ``evidence`` (per rank, keyed by rank as text)
    and ``summary`` (one sentence).
    """
    # The report of a 16k-rank hang is a million small lists and dicts without cycles: collections
    # triggered while it is built would walk all of it again and again.
    with paused_gc():
        return _analyze(table, silence_s)


def _analyze(table: pa.Table | pl.DataFrame, silence_s: float) -> dict[str, Any]:
    df = gather.frame(table)
    report: dict[str, Any] = {
        "verdict": "insufficient_evidence",
        "root_cause_ranks": [],
        "stuck_groups": [],
        "chain": [],
        "wait_paths": [],
        "mismatches": [],
        "failures": {},
        "evidence": {},
        "summary": "",
    }
    if df.is_empty():
        report["summary"] = "No operations in the evidence."
        return report

    coll, rest = gather.split(df)
    per_rank = gather.per_rank_streams(coll)
    members, info = gather.members_and_info(per_rank, rest, df)
    evidence_ranks = set(pl.concat([per_rank.get_column("rank"), rest.get_column("rank")]).unique().to_list())
    world = set(members.get_column("rank").unique().to_list()) | evidence_ranks
    no_evidence = sorted(world - evidence_ranks)
    activity = gather.rank_activity(per_rank, rest)
    last_ns = dict(zip(activity["rank"].to_list(), activity["last_activity_ns"].to_list(), strict=True))
    desc_of = {c: d for c, d, _ in info.iter_rows()}

    grid = gather.collective_streams(per_rank, members, sorted(evidence_ranks))
    stuck = gather.stuck_streams(grid)
    near = gather.open_rows(coll, stuck)
    at = gather.ops_at(near)
    mism = gather.mismatches(near)
    p2p, p2p_ops = gather.pending_p2p(rest)

    # Representative op/shape/dtype at each blocking seq and when ranks were first seen entering it.
    stuck = stuck.join(gather.representatives(at), on=["comm_id", "seq_kind", "sop"], how="left")

    mismatch_at: dict[tuple, dict] = {}
    mismatches = []
    if not mism.is_empty():
        for key, rows in mism.sort("seq", "rank").group_by(["comm_id", "seq_kind", "sop", "seq"], maintain_order=True):
            comm_id, seq_kind, sop, seq = key
            item = {"group_id": comm_id, "group_desc": desc_of.get(comm_id), "seq": int(seq), "fields": {}}
            minority: set[int] = set()
            for field in ("op", "dtype", "count"):
                by_value: dict[str, list[int]] = defaultdict(list)
                for rank, value in rows.select("rank", field).iter_rows():
                    if value is not None and value != "":
                        by_value[str(value)].append(int(rank))
                if len(by_value) > 1:
                    item["fields"][field] = {k: v[:MAX_LISTED] for k, v in by_value.items()}
                    largest = max(len(v) for v in by_value.values())
                    majority = [k for k, v in by_value.items() if len(v) == largest]
                    if len(majority) == 1:
                        minority.update(r for k, v in by_value.items() if k != majority[0] for r in v)
                    else:
                        minority.update(r for v in by_value.values() for r in v)
            if not item["fields"]:
                continue
            item["ranks"] = sorted(minority)
            mismatches.append(item)
            mismatch_at[(comm_id, seq_kind, sop, int(seq))] = item
            if len(mismatches) >= 100:
                break

    edges: dict[int, set[int]] = defaultdict(set)
    blocked_by: dict[int, list[dict]] = defaultdict(list)
    waiting_in: dict[int, list[str]] = defaultdict(list)
    missing_from: dict[int, list[str]] = defaultdict(list)
    lagging_in: dict[int, list[str]] = defaultdict(list)
    mismatch_roots: list[int] = []
    stuck_groups = []
    # Which stuck group each pending operation belongs to, and whom that group waits for: a rank
    # blocked in its first pending operation waits for that group's blockers ("missing because
    # blocked earlier", below).
    group_of: dict[tuple, dict] = {}
    blockers_of: dict[int, list[int]] = {}

    stuck_rows = gather.rows(
        stuck.sort("comm_id", "seq_kind", "sop"),
        "comm_id",
        "seq_kind",
        "sop",
        "seq",
        "s_complete",
        "has_missing",
        "entered_ranks",
        "missing_ranks",
        "waiting",
        "lagging",
        "ahead",
        "op",
        "shape",
        "dtype",
        "first_ns",
    )
    # One pass per stuck stream (thousands in a large layout: every communicator has an operation in
    # flight), so the lookups are bound once.
    desc_get = desc_of.get
    for (
        comm_id,
        seq_kind,
        sop,
        seq,
        s_complete,
        has_missing,
        entered,
        missing,
        waiting,
        lagging,
        ahead,
        op,
        shape,
        dtype,
        entered_ns,
    ) in stuck_rows:
        key = (comm_id, seq_kind, sop)
        mismatch = (mismatch_at.get((*key, seq)) or mismatch_at.get((*key, s_complete or -1))) if mismatch_at else None
        if mismatch:
            kind = "mismatch"
            mismatch_roots.extend(mismatch["ranks"])
        elif has_missing:
            kind = "missing_ranks"
        elif lagging:
            kind = "lagging_ranks"
        else:
            kind = "all_inside"
        if mismatch and len(mismatch["ranks"]) < len(entered):
            # Ranks that called the majority op wait for the ones that called something else.
            blockers = [r for r in mismatch["ranks"] if r in entered]
            waiters = [r for r in entered if r not in blockers]
        elif has_missing:
            blockers, waiters = missing, waiting
        elif lagging:
            blockers, waiters = lagging, [r for r in ahead if r not in lagging]
        else:
            blockers, waiters = [], []
        group = {
            "group_id": comm_id,
            "group_desc": desc_get(comm_id),
            "op": op or (sop or None),
            "seq": seq,
            "seq_kind": seq_kind,
            "shape": shape,
            "dtype": dtype,
            "entered_ranks": entered,
            "missing_ranks": missing,
            "kind": kind,
            "waiting_ranks": waiting,
            "lagging_ranks": lagging,
            "lowest_incomplete_seq": s_complete,
            "first_entered_ns": entered_ns,
        }
        if mismatch:
            group["mismatch"] = mismatch["fields"]
        stuck_groups.append(group)
        for r in lagging:
            lagging_in[r].append(comm_id)
        for r in missing:
            missing_from[r].append(comm_id)
        for r in waiting:
            waiting_in[r].append(comm_id)
        group_of[key] = group
        blockers_of[id(group)] = blockers
        for b in blockers:
            blocked_by[b].append(group)
            for w in waiters:
                if w != b:
                    edges[w].add(b)

    # Program order matters only for the ranks others wait for and the ranks in pending P2P pairs.
    needed = set(blocked_by) | set(p2p_ops.get_column("rank").unique().to_list())
    first_pending = gather.earliest_pending(near, per_rank, p2p_ops, needed)

    for row in p2p.iter_rows(named=True):
        sends, recvs = int(row["sends"]), int(row["recvs"])
        if sends == recvs == 0:
            continue
        src, dst = int(row["src"]), int(row["dst"])
        waiter: int | None
        blocker: int | None
        if sends > recvs:
            waiter, blocker, op = src, dst, "send"
        elif recvs > sends:
            waiter, blocker, op = dst, src, "recv"
        else:
            waiter, blocker, op = None, None, "send/recv"
        kind = "p2p_unmatched" if blocker is not None else "p2p_inside"
        late: list[int] = []
        if blocker is None and sends:
            # Both sides posted. A side whose stream is still busy with an earlier operation has not
            # reached its part yet: the other side waits for it.
            comm = row["comm_id"]
            late = [
                r
                for r, t, rid in ((src, row["t_send"], row["rid_send"]), (dst, row["t_recv"], row["rid_recv"]))
                if blocked_earlier(first_pending.get(r), t, rid, p2p_comm=comm)
            ]
            if len(late) == 1:
                blocker = late[0]
                waiter = dst if blocker == src else src
            else:
                late = []
        if waiter is not None and waiter in lagging_in:
            # The waiter's own completions stalled (its GPU stopped), so its pending P2P ops may well
            # have completed on the peer: they are no evidence against the peer.
            kind, blocker = "p2p_waiter_stalled", None
        group = {
            "group_id": row["comm_id"],
            "group_desc": desc_of.get(row["comm_id"]),
            "op": op,
            "seq": int(row["first_seq"]) if row["first_seq"] is not None else None,
            "seq_kind": "p2p",
            "shape": None,
            "dtype": None,
            "entered_ranks": sorted({src, dst} - ({blocker} if blocker is not None and not late else set())),
            "missing_ranks": [blocker] if blocker is not None and not late else [],
            "kind": kind,
            "waiting_ranks": [waiter] if waiter is not None else [src, dst],
            "lagging_ranks": [],
            "lowest_incomplete_seq": None,
            "first_entered_ns": None,
            "pending_sends": sends,
            "pending_recvs": recvs,
            "src": src,
            "dst": dst,
        }
        if late:
            group["blocked_earlier_ranks"] = late
        stuck_groups.append(group)
        group_of[(row["comm_id"], src, dst)] = group
        blockers_of[id(group)] = [blocker] if blocker is not None else []
        if blocker is not None and waiter is not None:
            edges[waiter].add(blocker)
            blocked_by[blocker].append(group)
            if not late:
                missing_from[blocker].append(row["comm_id"])
            waiting_in[waiter].append(row["comm_id"])

    # Missing because blocked earlier: a rank that others wait for but that is itself inside an
    # earlier pending operation (its own program order) is not where progress stopped; it waits
    # for whoever blocks that operation.
    for r in sorted(blocked_by):
        first = first_pending.get(r)
        if first is None:
            continue
        if first["is_p2p"]:
            pair = (r, first["peer"]) if first["op"] == "send" else (first["peer"], r)
            target = group_of.get((first["comm_id"], *pair))
        else:
            target = group_of.get((first["comm_id"], first["seq_kind"], first["sop"]))
        if target is None:
            continue
        for b in blockers_of.get(id(target), []):
            if b != r:
                edges[r].add(b)

    # Root causes: the sink components among the ranks somebody waits for.
    blockers_all = set(blocked_by)
    sinks = sink_components(edges, blockers_all) if blockers_all else []

    def progress_key(rank: int) -> tuple:
        t = last_ns.get(rank)
        return (rank in evidence_ranks, t if t is not None else float("inf"), rank)

    roots: list[int] = []
    for r in dict.fromkeys(mismatch_roots):
        roots.append(r)
    for component in sorted(sinks, key=lambda c: min(progress_key(r) for r in c)):
        for r in sorted(component, key=progress_key):
            if r not in roots:
                roots.append(r)
    stalled = sorted(lagging_in, key=lambda r: (-len(lagging_in[r]), progress_key(r)))
    for r in stalled:
        if r not in roots:
            roots.append(r)
    has_stuck = bool(stuck_groups)
    if has_stuck and not roots:
        # Everyone is inside the same operations: fall back on the ranks whose last progress is earliest.
        pending = sorted({r for g in stuck_groups for r in g["waiting_ranks"]})
        timed = [r for r in pending if last_ns.get(r) is not None]
        if timed:
            earliest = min(last_ns[r] for r in timed)
            roots = [r for r in timed if last_ns[r] == earliest]

    latest = max((t for t in last_ns.values() if t is not None), default=None)
    stopped = []
    if latest is not None:
        gap = int(silence_s * 1e9)
        stopped = sorted(r for r, t in last_ns.items() if t is not None and latest - t > gap)
    with_abandoned = activity.filter(pl.col("abandoned") > 0)
    abandoned = dict(
        zip(map(str, with_abandoned["rank"].to_list()), with_abandoned["abandoned"].to_list(), strict=True)
    )
    if abandoned:
        # Peers that were still alive when the job was aborted recorded their in-flight operations
        # as abandoned. A rank they wait for that recorded no abandonment and whose evidence ends
        # before theirs did not go on reporting to the end: it crashed, was killed, or is stuck
        # outside communication (the operations table alone cannot tell these apart).
        alive_until = max((last_ns.get(int(r)) or gather.NO_TIME) for r in abandoned)
        stopped = sorted(
            set(stopped)
            | {
                r
                for r in missing_from
                if str(r) not in abandoned and last_ns.get(r) is not None and last_ns[r] < alive_until
            }
        )

    chain = dependency_chain(roots, edges, blocked_by)

    # Per-rank evidence.
    last_ops = df.select("rank", "comm_id", "comm_desc", "comm_name", "op", "seq", "state", "shape", "dtype")[
        activity.get_column("last_row")
    ].with_columns(gather.DESC)
    evidence: dict[str, dict] = {}
    root_set = set(roots)
    no_evidence_set = set(no_evidence)
    columns = ("rank", "comm_id", "comm_desc", "op", "seq", "state", "shape", "dtype")
    for r, comm_id, desc, op, seq, state, shape, dtype in gather.rows(last_ops, *columns):
        evidence[str(r)] = {
            "last_op": {
                "group_id": comm_id,
                "group_desc": desc,
                "op": op,
                "seq": seq,
                "state": state,
                "shape": shape,
                "dtype": dtype,
            }
        }
    for r in sorted(world):
        name = str(r)
        item = evidence.get(name)
        if item is None:
            item = evidence[name] = {"last_op": None}
        if r in root_set:
            status = "root_cause"
        elif r in no_evidence_set:
            status = "no_evidence"
        elif r in missing_from:
            status = "missing"
        elif r in waiting_in:
            status = "waiting"
        else:
            status = "idle"
        item["status"] = status
        item["last_activity_ns"] = last_ns.get(r)
        if r in missing_from:
            item["missing_from"] = sorted(set(missing_from[r]))[:MAX_LISTED]
        if r in waiting_in:
            item["waiting_in"] = sorted(set(waiting_in[r]))[:MAX_LISTED]
        if r in lagging_in:
            item["completions_lag_in"] = sorted(set(lagging_in[r]))[:MAX_LISTED]
        first = first_pending.get(r)
        if first is not None:
            item["first_pending"] = {
                "group_id": first["comm_id"],
                "group_desc": desc_of.get(first["comm_id"]),
                "op": first["op"],
                "seq": first["seq"],
                "peer": first["peer"],
            }
        if edges.get(r):
            item["waits_on"] = sorted(edges[r])[:MAX_LISTED]
        if name in abandoned:
            item["abandoned_ops"] = abandoned[name]

    order = {"mismatch": 0, "missing_ranks": 1, "p2p_unmatched": 2, "lagging_ranks": 3, "p2p_inside": 4}

    # Within a kind, the group where ranks were first seen entering comes first: that is where
    # progress diverged earliest.
    def blocked_by_root(group: dict) -> bool:
        return not (
            root_set.isdisjoint(group["missing_ranks"])
            and root_set.isdisjoint(group["lagging_ranks"])
            and root_set.isdisjoint(group.get("blocked_earlier_ranks", ()))
        )

    # Within a kind, the groups the root causes block first (the others are knock-on effects).
    stuck_groups.sort(
        key=lambda g: (
            order.get(g["kind"], 5),
            not blocked_by_root(g),
            g["first_entered_ns"] if g["first_entered_ns"] is not None else float("inf"),
            -len(g["missing_ranks"]),
            str(g["group_id"]),
            g["seq"] if g["seq"] is not None else 0,
        )
    )

    if has_stuck:
        verdict = "hang"
    elif no_evidence or (activity.is_empty() and df.get_column("seq").null_count() == df.height):
        # Ranks without evidence, or neither an operation nor a progress counter (only membership
        # rows): nothing says whether the job moved on.
        verdict = "insufficient_evidence"
    else:
        verdict = "no_hang"
    report.update(
        verdict=verdict,
        root_cause_ranks=roots,
        stuck_groups=stuck_groups,
        chain=chain,
        wait_paths=wait_paths(chain),
        mismatches=mismatches,
        failures={
            "no_evidence_ranks": no_evidence,
            "stopped_reporting_ranks": stopped,
            "abandoned_ops": abandoned,
            "stalled_completion_ranks": stalled,
        },
        evidence=evidence,
        summary=summary_sentence(verdict, roots, stuck_groups, no_evidence, len(world)),
    )
    return report
