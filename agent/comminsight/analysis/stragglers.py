"""Straggler attribution: who arrives late, who waits for whom, and how much faster without them.

1. **Matching.** Each collective is matched across its members by (communicator, seq);
   point-to-point operations by (communicator, sender, receiver, n-th transfer) when peers are
   known, else by completion time (a send and its receive finish together). Per member:
   arrival (start), lateness (arrival minus the earliest member's) and waiting (time inside the
   operation before the last member arrived). The straggler arrives last and waits least.
2. **Indices per step and rank.** score = (lateness - waiting) / the step's largest |lateness -
   waiting|, in [-1, 1]; ``straggler_index`` is its mean over steps; ``lateness_share`` the
   rank's share of the step's total lateness; ``consistency`` the share of steps in which the
   rank scored highest; ``compute_gap_growth`` how much longer the rank's time outside
   communication is than the median rank's.
3. **Causal waiting.** Every member that waited is linked to the member that arrived last.
4. **What-if.** A replay of each step on its dependency graph: each event starts after the
   previous one on its rank plus the observed gap, and a matched operation ends when its last
   member has arrived plus the observed transfer. Making a set of ranks "not slow" replaces
   their gaps and local (compute) durations by the median of the other ranks for the same
   operation; the replayed step time with and without gives the slowdown attributed to them.
   Culprits are chosen greedily among single ranks and parallel-coordinate groups (a DP rank, a
   PP stage, a TP rank) while removing the next one still saves ``min_gain`` of the step time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl
import pyarrow as pa

COORDS = ("dp_rank", "pp_rank", "tp_rank")
P2P_TOLERANCE_NS = 20_000


def match_operations(df: pl.DataFrame) -> pl.DataFrame:
    """Per event: ``group`` (matched instance id, -1 local), ``arrival_ns``, ``lateness_ns``, ``wait_ns``, ``n_members``.

    ``df`` must carry a ``row`` column (row index); the result is in ``row`` order.
    """
    arrival = pl.coalesce(pl.col("start_ns"), pl.col("enqueue_ns"))
    base = df.select("row", "rank", "comm_id", "op", "is_p2p", "seq", "peer", "comm_size", "start_ns", "end_ns", "enqueue_ns")
    base = base.with_columns(arrival_ns=arrival, end_ns=pl.coalesce(pl.col("end_ns"), arrival))
    coll = base.filter(~pl.col("is_p2p") & (pl.col("op") != "compute") & (pl.col("comm_size").fill_null(2) > 1))
    coll = coll.with_columns(key=pl.concat_str([pl.lit("c"), pl.col("comm_id"), pl.col("seq").cast(pl.String)], separator="|"))
    p2p = base.filter(pl.col("is_p2p"))
    with_peer = p2p.filter(pl.col("peer").is_not_null())
    with_peer = with_peer.with_columns(
        sender=pl.when(pl.col("op") == "send").then(pl.col("rank")).otherwise(pl.col("peer")),
        receiver=pl.when(pl.col("op") == "send").then(pl.col("peer")).otherwise(pl.col("rank")),
    ).with_columns(k=pl.col("arrival_ns").rank("ordinal").over("rank", "comm_id", "op", "peer"))
    with_peer = with_peer.with_columns(
        key=pl.concat_str(
            [pl.lit("p"), pl.col("comm_id"), pl.col("sender").cast(pl.String), pl.col("receiver").cast(pl.String), pl.col("k").cast(pl.String)],
            separator="|",
        )
    ).drop("sender", "receiver", "k")
    no_peer = p2p.filter(pl.col("peer").is_null()).sort("comm_id", "end_ns")
    # Without peers, a transfer's two sides are the events that complete together.
    no_peer = no_peer.with_columns(
        brk=(
            (pl.col("end_ns").diff().over("comm_id").fill_null(P2P_TOLERANCE_NS + 1) > P2P_TOLERANCE_NS)
        ).cast(pl.Int64)
    ).with_columns(key=pl.concat_str([pl.lit("q"), pl.col("comm_id"), pl.col("brk").cum_sum().over("comm_id").cast(pl.String)], separator="|")).drop("brk")
    matched = pl.concat([coll, with_peer, no_peer], how="vertical_relaxed")
    stats = matched.group_by("key").agg(
        first=pl.col("arrival_ns").min(), last=pl.col("arrival_ns").max(), n_members=pl.col("rank").n_unique()
    ).filter(pl.col("n_members") > 1).with_columns(group=pl.int_range(pl.len(), dtype=pl.Int64))
    matched = matched.join(stats, on="key", how="inner").select(
        "row",
        "group",
        "n_members",
        lateness_ns=pl.col("arrival_ns") - pl.col("first"),
        wait_ns=(pl.min_horizontal(pl.col("last"), pl.col("end_ns")) - pl.col("arrival_ns")).clip(lower_bound=0),
        last_arrival_ns=pl.col("last"),
    )
    out = base.select("row", "rank", "arrival_ns").join(matched, on="row", how="left").sort("row")
    return out.with_columns(
        pl.col("group").fill_null(-1),
        pl.col("n_members").fill_null(1),
        pl.col("lateness_ns").fill_null(0),
        pl.col("wait_ns").fill_null(0),
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
    joined = rows.join_asof(starts, left_on="key", right_on="start_ns", by="rank", strategy="backward")
    steps = joined.select("row", "_step").sort("row")
    return df.join(steps, on="row", how="left").with_columns(pl.col("_step").fill_null(-1)), f"recovered ({report.method})"


def _replay(ev: dict[str, np.ndarray], gap: np.ndarray, work: np.ndarray, max_iter: int = 100_000) -> np.ndarray:
    """End time of every event under the replay model (see module doc); all steps at once."""
    end = ev["step_start"].astype(np.float64).copy()
    prev = ev["prev"]
    first = prev < 0
    group = ev["group_dense"]
    n_groups = int(group.max()) + 1 if group.size else 0
    for _ in range(max_iter):
        before = np.where(first, ev["step_start"], end[np.maximum(prev, 0)])
        arrive = before + gap
        last = np.full(n_groups, -np.inf)
        np.maximum.at(last, group, arrive)
        new_end = last[group] + work
        if np.array_equal(new_end, end):
            break
        end = new_end
    return end


def _prepare_replay(df: pl.DataFrame, matches: pl.DataFrame) -> tuple[pl.DataFrame, dict[str, np.ndarray]]:
    ev = df.join(matches.select("row", "group", "last_arrival_ns"), on="row", how="left").filter(pl.col("_step") >= 0)
    ev = ev.with_columns(s=pl.coalesce("start_ns", "enqueue_ns"), e=pl.coalesce("end_ns", "start_ns", "enqueue_ns"))
    ev = ev.filter(pl.col("s").is_not_null()).sort("rank", "_step", "s", "row")
    ev = ev.with_columns(
        step_start=pl.col("s").min().over("_step"),
        label=pl.coalesce("comm_name", "op"),
    ).with_columns(
        occurrence=pl.col("s").rank("ordinal").over("rank", "_step", "label"),
        prev_end=pl.col("e").shift(1).over("rank", "_step"),
    )
    n = ev.height
    idx = np.arange(n)
    same = np.zeros(n, dtype=bool)
    r = ev.get_column("rank").to_numpy()
    st = ev.get_column("_step").to_numpy()
    same[1:] = (r[1:] == r[:-1]) & (st[1:] == st[:-1])
    prev = np.where(same, idx - 1, -1)
    grp = ev.get_column("group").fill_null(-1).to_numpy()
    # Local events get their own group; matched ones share their instance's.
    dense = np.where(grp >= 0, grp, -1)
    local = dense < 0
    dense = dense.astype(np.int64)
    dense[local] = (grp.max(initial=-1) + 1) + np.arange(int(local.sum()))
    _, dense = np.unique(dense, return_inverse=True)
    s = ev.get_column("s").to_numpy().astype(np.float64)
    e = ev.get_column("e").to_numpy().astype(np.float64)
    step_start = ev.get_column("step_start").to_numpy().astype(np.float64)
    prev_end = np.where(prev >= 0, e[np.maximum(prev, 0)], step_start)
    gap = np.maximum(s - prev_end, 0.0)
    last_arrival = ev.get_column("last_arrival_ns").to_numpy().astype(np.float64)
    matched = ~local
    work = np.where(matched, np.maximum(e - np.where(np.isnan(last_arrival), s, last_arrival), 0.0), e - s)
    arrays = {
        "prev": prev,
        "group_dense": dense,
        "step_start": step_start,
        "gap": gap,
        "work": work,
        "matched": matched,
        "rank": r,
        "step": st,
    }
    return ev, arrays


def _reference(ev: pl.DataFrame, values: np.ndarray, culprit_mask: np.ndarray) -> np.ndarray:
    """Median of ``values`` over the non-culprit ranks for the same (step, label, occurrence); NaN if none."""
    frame = ev.select("_step", "label", "occurrence").with_columns(v=pl.Series(values), c=pl.Series(culprit_mask))
    ref = frame.with_columns(ref=pl.col("v").filter(~pl.col("c")).median().over("_step", "label", "occurrence"))
    return ref.get_column("ref").to_numpy().astype(np.float64)


def _step_times(arrays: dict[str, np.ndarray], end: np.ndarray) -> np.ndarray:
    steps, inv = np.unique(arrays["step"], return_inverse=True)
    hi = np.full(steps.size, -np.inf)
    lo = np.full(steps.size, np.inf)
    np.maximum.at(hi, inv, end)
    np.minimum.at(lo, inv, arrays["step_start"])
    return hi - lo


def _what_if(ev: pl.DataFrame, arrays: dict[str, np.ndarray], culprits: set[int], base_total: float) -> float:
    """Replayed total time with ``culprits`` made not slow."""
    mask = np.isin(arrays["rank"], list(culprits))
    gap, work = arrays["gap"].copy(), arrays["work"].copy()
    ref_gap = _reference(ev, gap, mask)
    ok = mask & ~np.isnan(ref_gap)
    gap[ok] = np.minimum(gap[ok], ref_gap[ok])
    local = ~arrays["matched"]
    ref_work = _reference(ev, np.where(local, work, np.nan), mask)
    ok = mask & local & ~np.isnan(ref_work)
    work[ok] = np.minimum(work[ok], ref_work[ok])
    return float(_step_times(arrays, _replay(arrays, gap, work)).sum())


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
    span = joined.filter(pl.col("_step") >= 0).group_by("_step", "rank").agg(
        busy=(pl.col("end_ns") - pl.col("start_ns")).filter(pl.col("op") != "compute").sum(),
        span=pl.col("end_ns").max() - pl.col("start_ns").min(),
        compute=(pl.col("end_ns") - pl.col("start_ns")).filter(pl.col("op") == "compute").sum(),
    )
    per = span.join(per, on=["_step", "rank"], how="left").fill_null(0).filter(pl.col("_step") >= 0)
    per = per.with_columns(
        outside=pl.when(pl.col("compute") > 0).then(pl.col("compute")).otherwise(pl.col("span") - pl.col("busy")),
        d=(pl.col("late") - pl.col("wait")).cast(pl.Float64),
    ).with_columns(
        score=pl.col("d") / pl.col("d").abs().max().over("_step").clip(lower_bound=1.0),
        late_share=pl.col("late") / pl.col("late").sum().over("_step").clip(lower_bound=1),
        gap_growth=pl.col("outside") / pl.col("outside").median().over("_step").clip(lower_bound=1) - 1.0,
    ).with_columns(top=(pl.col("score") == pl.col("score").max().over("_step")))
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
    rank_stats = rank_stats.join(late_stats, on="rank", how="left").fill_null(0.0).sort("straggler_index", descending=True)

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
    coords = [c for c in COORDS if c in df.columns and df.get_column(c).null_count() == 0 and df.get_column(c).n_unique() > 1]
    rank_coord = df.group_by("rank").agg([pl.col(c).first() for c in coords]) if coords else None
    candidates: list[tuple[str, set[int]]] = [(f"rank={r}", {r}) for r in ranks_all]
    by_coordinate: dict[str, dict] = {}
    if rank_coord is not None:
        for c in coords:
            by_coordinate[c.removesuffix("_rank")] = {}
            for value, grp in rank_coord.group_by(c):
                members = set(grp.get_column("rank").to_list())
                candidates.append((f"{c.removesuffix('_rank')}={value[0]}", members))
    index_of = dict(zip(rank_stats.get_column("rank").to_list(), rank_stats.get_column("straggler_index").to_list(), strict=True))
    gains: dict[str, float] = {}
    for name, members in candidates:
        total = _what_if(ev, arrays, members, base_total)
        gains[name] = base_total / total if total > 0 else 1.0
    for name, members in candidates:
        if "=" in name and not name.startswith("rank="):
            coord, value = name.split("=", 1)
            by_coordinate[coord][value] = {
                "ranks": sorted(members),
                "slowdown_ratio": gains[name],
                "mean_straggler_index": float(np.mean([index_of.get(m, 0.0) for m in members])),
            }
    chosen: set[int] = set()
    groups: list[dict] = []
    current = base_total
    for _ in range(max_culprit_groups):
        best_name, best_total, best_members = None, current, set()
        for name, members in candidates:
            if members <= chosen:
                continue
            total = _what_if(ev, arrays, chosen | members, base_total) if chosen else base_total / gains[name]
            if total < best_total - 1e-9 or (best_name is not None and abs(total - best_total) <= 1e-9 and len(members) < len(best_members)):
                best_name, best_total, best_members = name, total, members
        if best_name is None or (current - best_total) < min_gain * current:
            break
        new = sorted(best_members - chosen, key=lambda m: -index_of.get(m, 0.0))
        groups.append({"group": best_name, "ranks": new, "saves_ms_per_step": (current - best_total) / 1e6 / len(observed)})
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
    ranks_out = []
    for row in rank_stats.iter_rows(named=True):
        ranks_out.append(
            {
                "rank": int(row["rank"]),
                "straggler_index": float(row["straggler_index"]),
                "mean_lateness_ms": float(row["mean_lateness_ms"]),
                "waiting_ms": float(row["waiting_ms"]),
                "lateness_share": float(row["lateness_share"]),
                "consistency": float(row["consistency"]),
                "compute_gap_growth": float(row["compute_gap_growth"]),
                "slowdown_ratio_without": gains.get(f"rank={row['rank']}", 1.0),
            }
        )
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
