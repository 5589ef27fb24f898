"""Straggler attribution: who arrives late, who waits for whom, and how much faster without them.

1. **Matching.** Each collective is matched across its members by (communicator, op, seq);
   point-to-point operations by (communicator, sender, receiver, n-th transfer) when peers are
   known, else by completion time (a send and its receive finish together). Per member:
   arrival (start), lateness (arrival minus the earliest member's) and waiting (time inside the
   operation before the last member arrived). The straggler arrives last and waits least.
2. **Indices per step and rank.** score = (lateness - waiting) / the step's largest |lateness -
   waiting|, in [-1, 1]; ``arrival_score`` is its mean over steps; ``lateness_share`` the
   rank's share of the step's total lateness; ``consistency`` the share of steps in which the
   rank scored highest; ``compute_gap_growth`` how much longer the rank's time outside
   communication is than the median rank's. In a pipeline, arrival order follows the stage
   schedule, so these describe symptoms; ``straggler_index`` is the cause measure: the share of
   step time the what-if replay saves were the rank (or the culprit group holding it) not slow.
3. **Causal waiting.** Every member that waited is linked to the member that arrived last.
4. **What-if.** A replay of each step on its dependency graph: each event starts after the
   previous one on its rank plus the observed gap, and a matched operation ends when its last
   member has arrived plus the observed transfer. Making a set of ranks "not slow" replaces
   their gaps and local (compute) durations by the median of the other ranks for the same
   operation; the replayed step time with and without gives the slowdown attributed to them.
   Culprits are chosen greedily among single ranks and parallel-coordinate groups (a DP rank, a
   PP stage, a TP rank) while removing the next one still saves ``min_gain`` of the step time
   and at least 3x the median saving of single ranks (the jitter floor);
   among candidates saving at least 90% of the best saving, the one with the fewest ranks wins.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl
import pyarrow as pa

from comminsight.semantic.roles import infer_roles

COORDS = ("dp_rank", "pp_rank", "tp_rank")
NOISE_MULTIPLE = 3.0  # a culprit saves at least this many times the typical rank's saving
P2P_WINDOW_NS = 2_000_000  # a receive ends within this of its send handing over
WAIT_CLOCK_SLACK_NS = 50_000  # CPU issue times and GPU end times come from different clocks


def _pair_p2p(p2p: pl.DataFrame) -> pl.DataFrame:
    """recv row -> send row (``partner_row``) for point-to-point events.

    With peers: the n-th send from a to b pairs with the n-th receive on b from a. Without peers:
    a receive completes just after its send has handed the data over, so it pairs with the send
    on another rank of the same communicator that ended last before it (within P2P_WINDOW_NS).
    """
    with_peer = p2p.filter(pl.col("peer").is_not_null()).with_columns(
        sender=pl.when(pl.col("op") == "send").then(pl.col("rank")).otherwise(pl.col("peer")),
        receiver=pl.when(pl.col("op") == "send").then(pl.col("peer")).otherwise(pl.col("rank")),
    )
    with_peer = with_peer.with_columns(
        k=pl.col("arrival_ns").rank("ordinal").over("comm_id", "sender", "receiver", "op")
    )
    keys = ["comm_id", "sender", "receiver", "k"]
    peered = (
        with_peer.filter(pl.col("op") == "recv")
        .select("row", *keys)
        .join(with_peer.filter(pl.col("op") == "send").select(*keys, partner_row=pl.col("row")), on=keys, how="inner")
        .select("row", "partner_row")
    )
    no_peer = p2p.filter(pl.col("peer").is_null())
    recvs = no_peer.filter(pl.col("op") == "recv").select("row", "rank", "comm_id", "end_ns").sort("end_ns")
    sends = (
        no_peer.filter(pl.col("op") == "send")
        .select(
            partner_row=pl.col("row"), send_rank=pl.col("rank"), comm_id=pl.col("comm_id"), send_end=pl.col("end_ns")
        )
        .sort("send_end")
    )
    if recvs.height and sends.height:
        guessed = recvs.join_asof(
            sends,
            left_on="end_ns",
            right_on="send_end",
            by="comm_id",
            strategy="backward",
            tolerance=P2P_WINDOW_NS,
            check_sortedness=False,
        )
        guessed = guessed.filter(pl.col("partner_row").is_not_null() & (pl.col("send_rank") != pl.col("rank")))
        guessed = guessed.select("row", "partner_row")
    else:
        guessed = pl.DataFrame(schema={"row": pl.Int64, "partner_row": pl.Int64})
    return pl.concat([peered, guessed], how="vertical_relaxed")


def match_operations(df: pl.DataFrame) -> pl.DataFrame:
    """Per event: matched ``group`` (-1 local), ``partner_row`` (a receive's send), arrival, lateness, waiting.

    ``df`` must carry a ``row`` column (row index); the result is in ``row`` order.
    """
    arrival = pl.coalesce(pl.col("start_ns"), pl.col("enqueue_ns"))
    base = df.select(
        "row", "rank", "comm_id", "op", "is_p2p", "seq", "peer", "comm_size", "start_ns", "end_ns", "enqueue_ns"
    )
    base = base.with_columns(arrival_ns=arrival, end_ns=pl.coalesce(pl.col("end_ns"), arrival))
    coll = base.filter(~pl.col("is_p2p") & (pl.col("op") != "compute") & (pl.col("comm_size").fill_null(2) > 1))
    coll = coll.with_columns(
        key=pl.concat_str([pl.lit("c"), pl.col("comm_id"), pl.col("op"), pl.col("seq").cast(pl.String)], separator="|")
    )
    pairs = _pair_p2p(base.filter(pl.col("is_p2p")))
    # A transfer is a two-member group (receive and its send) for lateness and waiting.
    p2p_members = pl.concat(
        [
            pairs.select("row", key=pl.lit("p|") + pl.col("row").cast(pl.String)),
            pairs.select(row=pl.col("partner_row"), key=pl.lit("p|") + pl.col("row").cast(pl.String)),
        ]
    ).unique("row", keep="first")
    p2p = base.join(p2p_members, on="row", how="inner")
    matched = pl.concat([coll, p2p], how="vertical_relaxed")
    stats = (
        matched.group_by("key")
        .agg(first=pl.col("arrival_ns").min(), last=pl.col("arrival_ns").max(), n_members=pl.col("rank").n_unique())
        .filter(pl.col("n_members") > 1)
        .with_columns(group=pl.int_range(pl.len(), dtype=pl.Int64))
    )
    matched = matched.join(stats, on="key", how="inner").select(
        "row",
        "group",
        "n_members",
        "is_p2p",
        lateness_ns=pl.col("arrival_ns") - pl.col("first"),
        wait_ns=(pl.min_horizontal(pl.col("last"), pl.col("end_ns")) - pl.col("arrival_ns")).clip(lower_bound=0),
        last_arrival_ns=pl.col("last"),
    )
    out = base.select("row", "rank", "arrival_ns").join(matched, on="row", how="left").join(pairs, on="row", how="left")
    return out.sort("row").with_columns(
        pl.col("group").fill_null(-1),
        pl.col("n_members").fill_null(1),
        pl.col("lateness_ns").fill_null(0),
        pl.col("wait_ns").fill_null(0),
        pl.col("is_p2p").fill_null(False),
    )


@dataclass
class StragglerReport:
    ranks: list[dict]
    culprits: list[int]
    culprit_groups: list[dict]
    slowdown: dict
    by_coordinate: dict
    waiting_edges: list[dict]
    per_step: list[dict]
    step_source: str

    def to_dict(self) -> dict:
        out = {
            "ranks": self.ranks,
            "culprits": self.culprits,
            "culprit_groups": self.culprit_groups,
            "slowdown": self.slowdown,
            "waiting": self.waiting_edges,
            "per_step": self.per_step,
            "step_source": self.step_source,
        }
        if self.by_coordinate:
            out["by_coordinate"] = self.by_coordinate
        return out


def _with_steps(df: pl.DataFrame, use_labels: bool) -> tuple[pl.DataFrame, str]:
    """Give every row a step: the source labels when present (and allowed), else recovered steps."""
    if use_labels and "step" in df.columns and df.get_column("step").null_count() == 0:
        return df.with_columns(pl.col("step").alias("_step")), "labels"
    from comminsight.semantic.steps import recover_steps

    report = recover_steps(df.drop("row"))
    starts = report.rank_steps.select(pl.col("rank").cast(pl.Int64), "start_ns", _step=pl.col("step")).sort("start_ns")
    rows = df.select("row", pl.col("rank").cast(pl.Int64), key=pl.coalesce("start_ns", "enqueue_ns")).sort("key")
    joined = rows.join_asof(
        starts, left_on="key", right_on="start_ns", by="rank", strategy="backward", check_sortedness=False
    )
    steps = joined.select("row", "_step").sort("row")
    return df.join(steps, on="row", how="left").with_columns(
        pl.col("_step").fill_null(-1)
    ), f"recovered ({report.method})"


def _replay(ev: dict[str, np.ndarray], gap: np.ndarray, work: np.ndarray, sync: np.ndarray | None = None) -> np.ndarray:
    """End time of every event under the replay model (see module doc); all steps at once.

    Iterates from below to the least fixed point; each pass advances every dependency chain
    by at least one operation, so the passes are bounded by the longest chain. Matching
    errors can form cycles; the pass limit stops them (replay_error in the report shows it).
    """
    max_iter = int(ev["max_chain"]) + 16
    step_start = ev["step_start"] + ev["carry"]
    end = step_start.copy()
    prev, first = ev["prev"], ev["prev"] < 0
    group, batch, partner = ev["group_dense"], ev["batch"], ev["partner"]
    has_partner = partner >= 0
    safe_partner = np.maximum(partner, 0)
    n_groups = int(group.max()) + 1 if group.size else 0
    n_batches = int(batch.max()) + 1 if batch.size else 0
    safe_prev = np.maximum(prev, 0)
    waits_cpu, launch = ev["sync"] if sync is None else sync, ev["launch"]
    cpu = step_start.copy()
    for _ in range(max_iter):
        # The host issues an operation a gap after issuing the previous one, or after the
        # previous one completed when it waited for it; the device starts it once issued and
        # once the previous one on the rank has ended.
        base = np.where(first, step_start, np.where(waits_cpu, end[safe_prev], cpu[safe_prev]))
        new_cpu = base + gap
        arrive = np.maximum(new_cpu, np.where(first, -np.inf, end[safe_prev])) + launch
        last = np.full(n_groups, -np.inf)
        np.maximum.at(last, group, arrive)
        ready = last[group]
        ready = np.where(has_partner, np.maximum(ready, arrive[safe_partner]), ready)
        own = ready + work
        batch_end = np.full(n_batches, -np.inf)
        np.maximum.at(batch_end, batch, own)
        new_end = batch_end[batch]
        if np.array_equal(new_end, end) and np.array_equal(new_cpu, cpu):
            break
        end, cpu = new_end, new_cpu
    return end


def _prepare_replay(df: pl.DataFrame, matches: pl.DataFrame) -> tuple[pl.DataFrame, dict[str, np.ndarray]]:
    ev = df.join(matches.select("row", "group", "is_p2p", "last_arrival_ns", "partner_row"), on="row", how="left")
    ev = ev.filter(pl.col("_step") >= 0)
    # Host-issue model when every communication event says when the host enqueued it (profiler
    # evidence); compute rows are then step annotations, not work, and are left out.
    comm = ev.filter(pl.col("op") != "compute")
    issue_model = comm.height > 0 and comm.get_column("enqueue_ns").null_count() == 0
    if issue_model:
        ev = comm
    ev = ev.with_columns(s=pl.coalesce("start_ns", "enqueue_ns"), e=pl.coalesce("end_ns", "start_ns", "enqueue_ns"))
    ev = ev.filter(pl.col("s").is_not_null()).sort("rank", "_step", "s", "row")
    # What makes two ranks' operations "the same" for the what-if reference: the signature
    # (role, op, size); when sizes are unknown, the operation's name as the source gave it.
    roles = infer_roles(df.drop("row", "_step"))
    role = pl.col("comm_id").replace_strict(roles, default="other", return_dtype=pl.String)
    ev = ev.with_columns(
        step_start=pl.col("s").min().over("_step"),
        label=pl.when(pl.col("bytes").is_not_null())
        .then(pl.concat_str([role, pl.col("op"), pl.col("bytes").cast(pl.String)], separator="|"))
        .otherwise(pl.concat_str([role, pl.col("op"), pl.col("comm_name").fill_null("")], separator="|")),
    ).with_columns(occurrence=pl.col("s").rank("ordinal").over("rank", "_step", "label"))
    # A rank's program in a step: its sequence of operations. Ranks running the same program (a
    # pipeline stage's data- and tensor-parallel peers) are the best reference for each other.
    ev = ev.with_columns(program=pl.col("label").str.join("\n").over("rank", "_step", mapping_strategy="join").hash())
    n = ev.height
    idx = np.arange(n)
    r = ev.get_column("rank").to_numpy()
    st = ev.get_column("_step").to_numpy()
    s = ev.get_column("s").to_numpy().astype(np.float64)
    e = ev.get_column("e").to_numpy().astype(np.float64)
    same = np.zeros(n, dtype=bool)
    same[1:] = (r[1:] == r[:-1]) & (st[1:] == st[:-1])
    prev = np.where(same, idx - 1, -1)
    # Operations a rank issued at the same instant form a batch (grouped send/recv): each waits
    # for what preceded the batch, and the batch completes together.
    batched = np.zeros(n, dtype=bool)
    batched[1:] = same[1:] & (s[1:] == s[:-1])
    head = np.maximum.accumulate(np.where(~batched, idx, 0))
    prev = np.where(batched, prev[head], prev)
    _, batch = np.unique(head, return_inverse=True)
    # Symmetric groups: collectives, and each matched send with its receive (a send completes only
    # once the receiver has posted the receive: it waits for a late receiver as a receive waits for
    # a late sender). Local events and unmatched P2P get a group of their own.
    grp = ev.get_column("group").fill_null(-1).to_numpy()
    p2p = ev.get_column("is_p2p").fill_null(False).to_numpy()
    collective = grp >= 0
    dense = np.where(collective, grp, -1).astype(np.int64)
    dense[~collective] = grp.max(initial=-1) + 1 + np.arange(int((~collective).sum()))
    _, dense = np.unique(dense, return_inverse=True)
    # Receive -> index of its send in this ordering.
    pos = pl.DataFrame({"row": ev.get_column("row"), "pos": idx})
    partner = (
        ev.select("partner_row")
        .join(pos.rename({"row": "partner_row"}), on="partner_row", how="left", maintain_order="left")
        .get_column("pos")
        .fill_null(-1)
        .to_numpy()
        .astype(np.int64)
    )
    step_start = ev.get_column("step_start").to_numpy().astype(np.float64)
    # A rank's first event in a step: the time until the rank finished its previous step is
    # carried in (it belongs to earlier steps' dependencies); only the rest is its own gap.
    last_end = ev.group_by("rank", "_step").agg(_last=pl.col("e").max()).sort("rank", "_step")
    last_end = last_end.with_columns(_prev_last=pl.col("_last").shift(1).over("rank")).drop("_last")
    own_start = (
        ev.select("rank", "_step")
        .join(last_end, on=["rank", "_step"], how="left", maintain_order="left")
        .get_column("_prev_last")
        .fill_null(np.nan)
        .to_numpy()
        .astype(np.float64)
    )
    own_start = np.where(np.isnan(own_start), s, own_start)  # first step seen: no earlier end known
    # The step begins when the first rank has finished its previous step (or, for the first
    # step seen, when the first rank starts it).
    first_of = prev < 0
    candidate = np.where(first_of, np.minimum(own_start, s), np.inf)
    step_ids, inv = np.unique(st, return_inverse=True)
    begin = np.full(step_ids.size, np.inf)
    np.minimum.at(begin, inv, candidate)
    step_start = begin[inv]
    own_start = np.maximum(np.minimum(own_start, s), step_start)
    carry = np.where(prev < 0, own_start - step_start, 0.0)
    prev_end = np.where(prev >= 0, e[np.maximum(prev, 0)], own_start)
    if issue_model:
        q = ev.get_column("enqueue_ns").to_numpy().astype(np.float64)
        # An operation issued before its step began (set-up work enqueued early) is replayed as
        # issued when the step began: the replay starts no rank before the step does.
        q = np.minimum(np.maximum(q, np.where(prev < 0, own_start, -np.inf)), s)
        prev_q = np.where(prev >= 0, q[np.maximum(prev, 0)], own_start)
        labels = ev.get_column("label").to_numpy()
        prev_label = np.where(prev >= 0, labels[np.maximum(prev, 0)], "")
        place = pl.DataFrame(
            {
                "p": ev.get_column("program").to_numpy(),
                "a": prev_label,
                "b": labels,
                "k": ev.get_column("occurrence").to_numpy(),
            }
        )
        place_id = place.select(pl.struct("p", "a", "b", "k").rank("dense").cast(pl.Int64) - 1).to_series().to_numpy()
        sync = _host_waits(place_id, prev >= 0, q, prev_q, prev_end)
        gap = np.maximum(q - np.where(sync | (prev < 0), prev_end, prev_q), 0.0)
        launch = np.maximum(s - np.maximum(q, np.where(prev >= 0, prev_end, -np.inf)), 0.0)
    else:
        sync = np.ones(n, dtype=bool)
        gap = np.maximum(s - prev_end, 0.0)
        launch = np.zeros(n)
    last_arrival = ev.get_column("last_arrival_ns").to_numpy().astype(np.float64)
    ready = np.where(collective & ~np.isnan(last_arrival), np.maximum(s, last_arrival), s)
    ready = np.where(partner >= 0, np.maximum(ready, s[np.maximum(partner, 0)]), ready)
    work = np.maximum(e - ready, 0.0)
    # Within a batch only the member that finished last carries the batch's completion.
    batch_end = np.full(int(batch.max()) + 1 if n else 0, -np.inf)
    np.maximum.at(batch_end, batch, e)
    counts = np.bincount(np.unique(r * (st.max(initial=0) + 2) + st + 1, return_inverse=True)[1]) if n else np.ones(1)
    arrays = {
        "prev": prev,
        "group_dense": dense,
        "batch": batch,
        "partner": partner,
        "step_start": step_start,
        "carry": carry,
        "sync": sync,
        "launch": launch,
        "gap": gap,
        "work": work,
        "matched": collective | p2p,
        "rank": r,
        "step": st,
        "max_chain": np.int64(4 * int(counts.max(initial=1))),
        "ref_key": ev.select(pl.struct("_step", "label", "occurrence").rank("dense").cast(pl.Int64) - 1)
        .to_series()
        .to_numpy(),
        "peer_key": ev.select(pl.struct("_step", "program", "label", "occurrence").rank("dense").cast(pl.Int64) - 1)
        .to_series()
        .to_numpy(),
    }
    # Sort orders for the what-if medians, computed once (the values never change, only the mask).
    arrays["local_work"] = np.where(arrays["matched"], np.nan, work)
    for key in ("ref_key", "peer_key"):
        arrays[f"{key}_gap_order"] = np.lexsort((gap, arrays[key]))
        arrays[f"{key}_work_order"] = np.lexsort((arrays["local_work"], arrays[key]))
        arrays[f"{key}_sync_order"] = np.lexsort((sync, arrays[key]))
    return ev, arrays


def _host_waits(
    place: np.ndarray, has_prev: np.ndarray, q: np.ndarray, prev_q: np.ndarray, prev_end: np.ndarray
) -> np.ndarray:
    """Per event: did the host wait for the previous operation to complete before issuing it?

    Issuing after the previous operation ended does not prove a wait: a rank whose compute
    outlasts the operation (a straggler, or anyone when the operation was delayed) issues after
    the end anyway. Whether a host waits is a property of the program, so it is decided per place
    in it (the rank's program in the step, previous operation, operation, occurrence), over every
    rank and step running that program: it
    waits when the issue (nearly) always follows the end and the time from the end varies less
    than the time from the previous issue (a wait absorbs the others' lateness; compute does not).
    """
    if not has_prev.any():
        return np.zeros(q.size, dtype=bool)
    after = q >= prev_end - WAIT_CLOCK_SLACK_NS
    frame = pl.DataFrame(
        {"place": place, "after": after, "from_issue": q - prev_q, "from_end": q - prev_end, "ok": has_prev}
    ).filter(pl.col("ok"))
    spread = lambda c: pl.col(c).quantile(0.75) - pl.col(c).quantile(0.25)  # noqa: E731
    votes = frame.group_by("place").agg(
        waits=(pl.col("after").mean() >= 0.9) & (spread("from_end") <= spread("from_issue"))
    )
    waits = np.zeros(int(place.max()) + 1, dtype=bool)
    waits[votes.get_column("place").to_numpy()] = votes.get_column("waits").to_numpy()
    return has_prev & waits[place] & (q >= prev_end)


def _reference(
    key: np.ndarray, values: np.ndarray, culprit_mask: np.ndarray, order: np.ndarray | None = None
) -> np.ndarray:
    """Median of ``values`` over the non-culprit events with the same reference key; NaN if none.

    ``key`` is a dense id of (step, operation, occurrence). One sort, then the middle valid
    element(s) of each key are picked by their running count: no Python per key or event.
    """
    n_keys = int(key.max()) + 1 if key.size else 0
    valid = ~culprit_mask & ~np.isnan(values)
    if order is None:
        order = np.lexsort((values, key))
    k, v, ok = key[order], values[order], valid[order]
    count = np.bincount(k[ok], minlength=n_keys)
    seen = np.cumsum(ok)
    key_start = np.searchsorted(k, np.arange(n_keys))
    before = np.concatenate(([0], seen))[key_start]
    position = seen - before[k]  # 1-based position among this key's valid values
    lo_pos, hi_pos = (count + 1) // 2, count // 2 + 1
    lo = np.full(n_keys, np.nan)
    hi = np.full(n_keys, np.nan)
    pick = ok & (position == lo_pos[k])
    lo[k[pick]] = v[pick]
    pick = ok & (position == hi_pos[k])
    hi[k[pick]] = v[pick]
    return ((lo + hi) / 2.0)[key]


def _step_times(arrays: dict[str, np.ndarray], end: np.ndarray) -> np.ndarray:
    steps, inv = np.unique(arrays["step"], return_inverse=True)
    hi = np.full(steps.size, -np.inf)
    lo = np.full(steps.size, np.inf)
    np.maximum.at(hi, inv, end)
    np.minimum.at(lo, inv, arrays["step_start"])
    return hi - lo


def _typical(arrays: dict[str, np.ndarray], values: np.ndarray, name: str, mask: np.ndarray) -> np.ndarray:
    """Per event, the median of ``values`` over the non-culprit ranks doing the same thing.

    Preferably ranks that ran the same program in the step (same operations in the same order:
    a pipeline stage's peers), else any rank with the same operation and occurrence in the step.
    """
    peers = _reference(arrays["peer_key"], values, mask, arrays[f"peer_key_{name}_order"])
    anyone = _reference(arrays["ref_key"], values, mask, arrays[f"ref_key_{name}_order"])
    return np.where(np.isnan(peers), anyone, peers)


def _what_if(ev: pl.DataFrame, arrays: dict[str, np.ndarray], culprits: set[int], base_total: float) -> float:
    """Replayed total time with ``culprits`` made not slow."""
    mask = np.isin(arrays["rank"], list(culprits))
    gap, work = arrays["gap"].copy(), arrays["work"].copy()
    ref_gap = _typical(arrays, gap, "gap", mask)
    ok = mask & ~np.isnan(ref_gap)
    gap[ok] = ref_gap[ok]  # "not slow" means "like the others", not "faster than everyone"
    # A gap is measured from the previous issue, or from the completion the host waited for; the
    # culprit takes the others' gap together with how they measured it.
    ref_sync = _typical(arrays, arrays["sync"].astype(np.float64), "sync", mask)
    sync = arrays["sync"].copy()
    ok = mask & ~np.isnan(ref_sync)
    sync[ok] = ref_sync[ok] >= 0.5
    local = ~arrays["matched"]
    ref_work = _typical(arrays, arrays["local_work"], "work", mask)
    ok = mask & local & ~np.isnan(ref_work)
    work[ok] = ref_work[ok]
    return float(_step_times(arrays, _replay(arrays, gap, work, sync)).sum())


def analyse_stragglers(
    table: pa.Table | pl.DataFrame, use_labels: bool = True, min_gain: float = 0.02, max_culprit_groups: int = 3
) -> StragglerReport:
    """Straggler report for an operations table (see module doc)."""
    df = table if isinstance(table, pl.DataFrame) else pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)
    df = df.with_row_index("row").with_columns(pl.col("row").cast(pl.Int64))
    if df.height == 0:
        raise ValueError("no operations to analyse")
    df, step_source = _with_steps(df, use_labels)
    matches = match_operations(df)
    joined = df.select("row", "rank", "_step", "op", "start_ns", "end_ns").join(
        matches.select("row", "group", "lateness_ns", "wait_ns", "n_members"), on="row"
    )
    ranks_all = sorted(joined.get_column("rank").unique().to_list())
    in_group = joined.filter(pl.col("group") >= 0)

    # Per (step, rank): lateness, waiting, time outside communication.
    per = in_group.group_by("_step", "rank").agg(late=pl.col("lateness_ns").sum(), wait=pl.col("wait_ns").sum())
    span = (
        joined.filter(pl.col("_step") >= 0)
        .group_by("_step", "rank")
        .agg(
            busy=(pl.col("end_ns") - pl.col("start_ns")).filter(pl.col("op") != "compute").sum(),
            span=pl.col("end_ns").max() - pl.col("start_ns").min(),
            compute=(pl.col("end_ns") - pl.col("start_ns")).filter(pl.col("op") == "compute").sum(),
        )
    )
    per = span.join(per, on=["_step", "rank"], how="left").fill_null(0).filter(pl.col("_step") >= 0)
    per = (
        per.with_columns(
            outside=pl.when(pl.col("compute") > 0).then(pl.col("compute")).otherwise(pl.col("span") - pl.col("busy")),
            d=(pl.col("late") - pl.col("wait")).cast(pl.Float64),
        )
        .with_columns(
            score=pl.col("d") / pl.col("d").abs().max().over("_step").clip(lower_bound=1.0),
            late_share=pl.col("late") / pl.col("late").sum().over("_step").clip(lower_bound=1),
            gap_growth=pl.col("outside") / pl.col("outside").median().over("_step").clip(lower_bound=1) - 1.0,
        )
        .with_columns(top=(pl.col("score") == pl.col("score").max().over("_step")))
    )
    n_steps = max(per.get_column("_step").n_unique(), 1)
    rank_stats = per.group_by("rank").agg(
        straggler_index=pl.col("score").mean(),
        lateness_share=pl.col("late_share").mean(),
        consistency=pl.col("top").sum() / n_steps,
        compute_gap_growth=pl.col("gap_growth").median(),
    )
    late_stats = in_group.group_by("rank").agg(
        mean_lateness_ms=pl.col("lateness_ns").mean() / 1e6, waiting_ms=pl.col("wait_ns").sum() / 1e6
    )
    rank_stats = (
        rank_stats.join(late_stats, on="rank", how="left")
        .with_columns(pl.col("mean_lateness_ms", "waiting_ms").fill_null(0.0))
        .sort("straggler_index", descending=True)
    )

    # Causal waiting: each waiting member -> the last arriver of that instance.
    arrivals = in_group.join(matches.select("row", "arrival_ns"), on="row")
    last_of = arrivals.sort("arrival_ns").group_by("group").agg(waited_for=pl.col("rank").last())
    edges = (
        arrivals.join(last_of, on="group")
        .filter((pl.col("rank") != pl.col("waited_for")) & (pl.col("wait_ns") > 0))
        .group_by("rank", "waited_for")
        .agg(wait_ms=pl.col("wait_ns").sum() / 1e6, count=pl.len())
        .sort("wait_ms", descending=True)
        .head(50)
        .rename({"rank": "waiter"})
    )

    # What-if replay.
    ev, arrays = _prepare_replay(df, matches)
    observed = _step_times(arrays, ev.get_column("e").to_numpy().astype(np.float64))
    base_total = float(_step_times(arrays, _replay(arrays, arrays["gap"], arrays["work"])).sum())
    coords = [
        c for c in COORDS if c in df.columns and df.get_column(c).null_count() == 0 and df.get_column(c).n_unique() > 1
    ]
    rank_coord = df.group_by("rank").agg([pl.col(c).first() for c in coords]) if coords else None
    candidates: list[tuple[str, set[int]]] = [(f"rank={r}", {r}) for r in ranks_all]
    by_coordinate: dict[str, dict] = {}
    if rank_coord is not None:
        for c in coords:
            by_coordinate[c.removesuffix("_rank")] = {}
            for value, grp in rank_coord.group_by(c):
                members = set(grp.get_column("rank").to_list())
                candidates.append((f"{c.removesuffix('_rank')}={value[0]}", members))
    index_of = dict(
        zip(rank_stats.get_column("rank").to_list(), rank_stats.get_column("straggler_index").to_list(), strict=True)
    )
    gains: dict[str, float] = {}
    if observed.size == 0 or base_total <= 0:
        candidates = []  # nothing timed to replay: no what-if, no culprits
    for name, members in candidates:
        total = _what_if(ev, arrays, members, base_total)
        gains[name] = base_total / total if total > 0 else 1.0
    for name, members in candidates:
        if "=" in name and not name.startswith("rank="):
            coord, coord_value = name.split("=", 1)
            by_coordinate[coord][coord_value] = {
                "ranks": sorted(members),
                "slowdown_ratio": gains[name],
                "mean_arrival_score": float(np.mean([index_of.get(m, 0.0) for m in members])),
            }
    chosen: set[int] = set()
    groups: list[dict] = []
    current = base_total
    for _ in range(max_culprit_groups):
        totals = {}
        for name, members in candidates:
            if members <= chosen:
                continue
            totals[name] = _what_if(ev, arrays, chosen | members, base_total) if chosen else base_total / gains[name]
        if not totals:
            break
        best_saving = current - min(totals.values())
        # Making any rank "typical" trims run-to-run jitter a little; a culprit must stand out
        # from that floor (the median saving over single ranks), not just clear min_gain.
        singles = [current - t for n, t in totals.items() if n.startswith("rank=")]
        floor = max(float(np.median(singles)), 0.0) if singles else 0.0
        if best_saving < max(min_gain * current, NOISE_MULTIPLE * floor):
            break
        # Among candidates saving nearly as much as the best, blame the fewest ranks.
        near = [n for n, t in totals.items() if current - t >= 0.9 * best_saving]
        best_name = min(near, key=lambda n: (len(dict(candidates)[n]), totals[n]))
        best_members = dict(candidates)[best_name]
        best_total = totals[best_name]
        new = sorted(best_members - chosen, key=lambda m: -index_of.get(m, 0.0))
        groups.append(
            {"group": best_name, "ranks": new, "saves_ms_per_step": (current - best_total) / 1e6 / len(observed)}
        )
        chosen |= best_members
        current = best_total
    culprits = [r for g in groups for r in g["ranks"]]
    observed_mean = float(observed.mean()) if observed.size else 0.0
    estimated = observed_mean * (current / base_total) if base_total > 0 else observed_mean
    slowdown = {
        "observed_step_ms": observed_mean / 1e6,
        "estimated_without_culprits_ms": estimated / 1e6,
        "ratio": observed_mean / estimated if estimated > 0 else 1.0,
        "replay_error": abs(base_total - float(observed.sum())) / max(float(observed.sum()), 1.0),
        "steps": int(observed.size),
    }
    # straggler_index: share of step time saved were the rank (or the culprit group holding it) not slow.
    saved = {r: 1.0 - 1.0 / gains.get(f"rank={r}", 1.0) for r in ranks_all}
    for name, members in candidates:
        if name.startswith("rank=") or not (members & chosen):
            continue
        for m in members:
            saved[m] = max(saved[m], 1.0 - 1.0 / gains[name])
    ranks_out = []
    for row in rank_stats.iter_rows(named=True):
        ranks_out.append(
            {
                "rank": int(row["rank"]),
                "straggler_index": max(0.0, float(saved.get(row["rank"], 0.0))),
                "arrival_score": float(row["straggler_index"]),
                "mean_lateness_ms": float(row["mean_lateness_ms"]),
                "waiting_ms": float(row["waiting_ms"]),
                "lateness_share": float(row["lateness_share"]),
                "consistency": float(row["consistency"]),
                "compute_gap_growth": float(row["compute_gap_growth"]),
                "slowdown_ratio_without": gains.get(f"rank={row['rank']}", 1.0),
            }
        )
    ranks_out.sort(key=lambda x: (-x["straggler_index"], -x["arrival_score"]))
    per_step = (
        per.sort("score", descending=True)
        .group_by("_step", maintain_order=True)
        .agg(top_rank=pl.col("rank").first(), top_score=pl.col("score").first())
        .sort("_step")
    )
    steps_ms = dict(zip(np.unique(arrays["step"]).tolist(), (observed / 1e6).tolist(), strict=True))
    per_step_out = [
        {"step": int(s), "duration_ms": steps_ms.get(s, 0.0), "top_rank": int(r), "top_score": float(v)}
        for s, r, v in per_step.iter_rows()
    ]
    return StragglerReport(
        ranks=ranks_out,
        culprits=culprits,
        culprit_groups=groups,
        slowdown=slowdown,
        by_coordinate=by_coordinate,
        waiting_edges=edges.to_dicts(),
        per_step=per_step_out,
        step_source=step_source,
    )
