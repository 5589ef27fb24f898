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
4. **What-if** (the OSDI'25 what-if analysis). Each step's dependency graph (program order per
   rank, collectives and send/receive pairs completing after their last member arrives plus the
   transfer, operations posted together completing together; with host enqueue times, issue and
   device execution apart; program order runs across step boundaries, so each scenario carries
   its own state from step to step) is replayed, level by level, for many scenarios at once. A
   step's time runs from the previous step's last end to its own. The ideal
   job has every operation and gap at its mean over ranks and steps (``slowdown.ratio`` =
   observed / ideal); the healthy job has each at most its lower quartile. Without compute rows
   in a pipeline, a compute gap is compared within its stage's program and the stages by their
   compute per step (``replay_inputs._StageReference``). Attribution replays
   the healthy job with one subset's observed durations restored (a rank, a DP/PP/TP group, a
   communicator, an operation kind): ``slowdown_ratio`` >= 1 by construction.
5. **Culprits** are chosen greedily by removal (the subset whose slowness costs most, then again
   with it removed, so a rank that only waited saves nothing), named only when the saving stands
   out from what the others of its kind save, clears that bar in most steps, and its own
   operations were slower than their peers' by more than the job's pooled noise; the smallest
   subset that explains the saving within noise is named (one late rank, not its TP group; a DP
   group, not one of its ranks; a slow link's communicator, not one end of it). Later rounds
   count only the ranks not yet named (theirs carry the culprit's effects). Candidates and
   scenarios are unions of atoms (a rank's events of one communicator and kind, matched or not,
   compute or not): the decision reads atom masks and per-atom, per-step sums, nothing per event.
   Without timings the report says the evidence is insufficient instead of guessing.

Matching, the indices' per-step sums and the replay's per-event columns are prepared window by window of whole
steps (``_preparation_windows``: no window cuts a collective or a send/receive pair); the windows are then read one
at a time, in order, and turned into the replay's inputs (``analysis.replay_inputs``: program order with each rank's
last operation carried from window to window, the references from passes over the windows, the replay's windows
planned and spilled, ``replay.WindowStore``): no step of the analysis holds every event at once, and the replays
and the culprit rounds hold no per-event array.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np
import polars as pl
import pyarrow as pa

from comminsight.analysis import replay as replay_module
from comminsight.analysis.replay import run as _run
from comminsight.analysis.replay_inputs import WAIT_CLOCK_SLACK_NS, ReplayInputs
from comminsight.semantic.matching import match_operations, p2p_pairs
from comminsight.semantic.order import canonical_order
from comminsight.semantic.roles import infer_coordinates, infer_roles, role_rows

COORDS = ("dp_rank", "pp_rank", "tp_rank", "cp_rank")
# Subset kinds in the order equal costs are listed in (single ranks first: the smallest answer).
SUBSET_KINDS = ("rank", "dp", "pp", "tp", "cp", "comm", "op")
NOISE_MULTIPLE = 3.0  # a culprit saves at least this many times the typical rank's saving
NOISE_SAMPLE = 24  # single ranks replayed again in later culprit rounds, for the noise bar
NULL_DRAWS = 256  # sets of ranks drawn from the reference to measure what a healthy set of that size shows
TEMPORAL_SE = 2.0  # a rank set's median excess must exceed this many robust standard errors over steps
TAIL_SHARE = 0.1  # a healthy rank's excess exceeds the reference's upper decile in this share of its steps
FAMILY_ALPHA = 0.05  # chance that any healthy rank of the job passes the across-steps test (_steadily_slow)
REPLAY_COLUMNS = (
    "row",
    "rank",
    "_step",
    "op",
    "is_p2p",
    "start_ns",
    "end_ns",
    "enqueue_ns",
    "bytes",
    "comm_id",
    "comm_name",
)
# Columns the windowed preparation reads (matching, statistics, the replay's).
_WINDOW_COLUMNS = (*REPLAY_COLUMNS, "seq", "peer", "comm_size")
# The columns the analysis reads of an operations table (roles and coordinates, the facts, the step engine's, the
# windows'); ``prepare_table`` keeps only these before putting the rows in order (a sorted copy of every column of
# the input held the input's other columns, names and lists, through the analysis).
TABLE_COLUMNS = (
    "rank",
    "op",
    "is_p2p",
    "peer",
    "comm_id",
    "comm_name",
    "comm_desc",
    "comm_size",
    "comm_ranks",
    *COORDS,
    "seq",
    "bytes",
    "start_ns",
    "end_ns",
    "enqueue_ns",
    "step",
)
PREPARE_ROWS = 1 << 15  # rows per preparation window of whole steps (at least one step)


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
    attribution: dict = field(default_factory=dict)
    evidence: str = "ok"
    ideal_step_ms: float = 0.0
    heatmap: dict = field(default_factory=dict)
    coordinates: str = "none"  # where the dp/pp/tp/cp groups came from: "input", "inferred" or "none"

    def to_dict(self) -> dict:
        out = {
            "ranks": self.ranks,
            "culprits": self.culprits,
            "culprit_groups": self.culprit_groups,
            "slowdown": self.slowdown,
            "waiting": self.waiting_edges,
            "per_step": self.per_step,
            "step_source": self.step_source,
            "evidence": self.evidence,
            "ideal_step_ms": self.ideal_step_ms,
            "attribution": self.attribution,
            "heatmap": self.heatmap,
            "coordinates": self.coordinates,
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
    return steps_from_starts(df, report.rank_steps), f"recovered ({report.method})"


def steps_from_starts(df: pl.DataFrame, rank_steps: pl.DataFrame) -> pl.DataFrame:
    """``df`` (with ``row``) with ``_step``: each row in the last of its rank's recovered steps (``rank_steps``:
    rank, step, start_ns) begun at or before it; -1 before the rank's first step."""
    starts = rank_steps.select(pl.col("rank").cast(pl.Int64), "start_ns", _step=pl.col("step")).sort("start_ns")
    rows = df.select("row", pl.col("rank").cast(pl.Int64), key=pl.coalesce("start_ns", "enqueue_ns")).sort("key")
    joined = rows.join_asof(
        starts, left_on="key", right_on="start_ns", by="rank", strategy="backward", check_sortedness=False
    )
    steps = joined.select("row", "_step").sort("row")
    return df.join(steps, on="row", how="left").with_columns(pl.col("_step").fill_null(-1))


def _preparation_windows(df: pl.DataFrame, pairs: pl.DataFrame, max_rows: int) -> list[tuple[int, int]]:
    """The preparation's windows of whole steps, in step order: (first, last) step label of each.

    A window takes consecutive steps while it holds at most ``max_rows`` rows (at least one step), and never
    ends between two steps that a collective instance or a send/receive pair spans (recovered steps cut per
    rank), so that matching a window's rows alone finds what matching the whole table finds. Rows before the
    first recovered step (step -1) go with the first window. Read per row: the step, and the keys of collectives
    and the pairs' rows (a few integer columns, not the table).
    """
    counts = df.group_by("_step").len().sort("_step")
    coll = instance_steps(df.lazy()).filter(pl.col("lo") < pl.col("hi")).select("lo", "hi").collect()
    spans = pl.concat([coll, pair_spans(pairs, df.select("row", "_step"))], how="vertical_relaxed")
    return window_bounds(counts, spans, max_rows)


def instance_steps(rows: pl.LazyFrame) -> pl.LazyFrame:
    """Per collective instance (comm_id, op, seq) of ``rows`` (with ``_step``): the lowest and highest step of its
    members' rows (``lo``, ``hi``). Those of disjoint sets of ranks merge by min and max."""
    return (
        rows.filter(~pl.col("is_p2p") & (pl.col("op") != "compute") & (pl.col("comm_size").fill_null(2) > 1))
        .filter(pl.col("comm_id").is_not_null() & pl.col("seq").is_not_null())
        .group_by("comm_id", "op", "seq")
        .agg(lo=pl.col("_step").min(), hi=pl.col("_step").max())
    )


def pair_spans(pairs: pl.DataFrame, step_of: pl.DataFrame) -> pl.DataFrame:
    """(``lo``, ``hi``) of the send/receive ``pairs`` whose two rows lie in different steps (``step_of``: row, _step
    of both rows of every pair)."""
    return (
        pairs.join(step_of, on="row")
        .join(step_of.rename({"row": "partner_row", "_step": "_partner_step"}), on="partner_row")
        .select(lo=pl.min_horizontal("_step", "_partner_step"), hi=pl.max_horizontal("_step", "_partner_step"))
        .filter(pl.col("lo") < pl.col("hi"))
    )


def window_bounds(counts: pl.DataFrame, spans: pl.DataFrame, max_rows: int) -> list[tuple[int, int]]:
    """The windows of ``_preparation_windows`` from the rows per step (``counts``: _step, len, sorted by step) and
    the (``lo``, ``hi``) steps of every collective instance or send/receive pair spanning more than one step."""
    steps = counts.get_column("_step").to_numpy()
    per_step = counts.get_column("len").to_numpy()
    lo = np.searchsorted(steps, spans.get_column("lo").to_numpy())
    hi = np.searchsorted(steps, spans.get_column("hi").to_numpy())
    open_count = np.zeros(steps.size + 1, np.int64)
    np.add.at(open_count, lo + 1, 1)
    np.add.at(open_count, hi + 1, -1)
    blocked = np.cumsum(open_count) > 0  # blocked[k]: no boundary between steps k - 1 and k
    if steps.size > 1 and steps[0] < 0:
        blocked[1] = True
    bounds, held = [0], 0
    for k in range(steps.size):
        if k > bounds[-1] and not blocked[k] and held + per_step[k] > max_rows:
            bounds.append(k)
            held = 0
        held += int(per_step[k])
    bounds.append(steps.size)
    return [(int(steps[a]), int(steps[b - 1])) for a, b in pairwise(bounds)]


@dataclass
class PreparationPlan:
    """What preparing a window of whole steps needs of the whole table, found first over a few columns: the windows
    (``_preparation_windows``), the send/receive pairs, the communicators' roles, whether the host-issue model
    applies, and per (rank, step) the start of the rank's first operation the replay keeps (``next_starts``, sorted:
    a window's compute rows are compared with the rank's next operation, which may lie in a later window). A window
    is then prepared alone (``prepare_window``), in any order."""

    windows: list[tuple[int, int]]
    pairs: pl.DataFrame
    roles: dict[str, str]
    issue_model: bool
    prepare: bool  # the replay's columns too (the evidence has timings)
    next_starts: pl.DataFrame

    def to_stored(self) -> tuple[dict, dict[str, pl.DataFrame]]:
        """The plan as a JSON document and frames (to store between a run's planning and its map tasks)."""
        doc = {"windows": self.windows, "roles": self.roles, "issue_model": self.issue_model, "prepare": self.prepare}
        return doc, {"pairs": self.pairs, "next_starts": self.next_starts}

    @classmethod
    def from_stored(cls, doc: dict, frames: dict[str, pl.DataFrame]) -> PreparationPlan:
        """The plan ``to_stored`` gave."""
        return cls(
            windows=[(int(lo), int(hi)) for lo, hi in doc["windows"]],
            pairs=frames["pairs"],
            roles=dict(doc["roles"]),
            issue_model=bool(doc["issue_model"]),
            prepare=bool(doc["prepare"]),
            next_starts=frames["next_starts"],
        )

    def after(self, index: int) -> pl.DataFrame:
        """Per rank, the start of its first kept operation after window ``index`` (ranks without one left out)."""
        hi = self.windows[index][1]
        later = self.next_starts.filter(pl.col("_step") > hi)
        return later.group_by("rank", maintain_order=True).agg(_next=pl.col("s").first())


@dataclass
class WindowPart:
    """One window's preparation: its share of the per-rank statistics (sums), the ranks it holds, how many matched
    groups it numbered (from 0), and the replay's per-event columns with strings as ids (from 1) of ``vocab``."""

    per: pl.DataFrame
    late: pl.DataFrame
    edges: pl.DataFrame
    ranks: list[int]
    n_groups: int
    columns: dict[str, np.ndarray]
    vocab: dict[str, list[str]]

    def to_frames(self) -> dict[str, pl.DataFrame]:
        """The part as frames (to store, e.g. as Parquet objects, between a map task and the merge)."""
        columns = {k: v for k, v in self.columns.items() if v.size or k != "q"}
        vocab = [(name, i, value) for name, values in self.vocab.items() for i, value in enumerate(values)]
        return {
            "per": self.per,
            "late": self.late,
            "edges": self.edges,
            "columns": pl.DataFrame(columns),
            "vocab": pl.DataFrame(vocab, schema={"name": pl.String, "i": pl.Int64, "value": pl.String}, orient="row"),
            "meta": pl.DataFrame({"rank": self.ranks}).with_columns(n_groups=pl.lit(self.n_groups, pl.Int64)),
        }

    @classmethod
    def from_frames(cls, frames: dict[str, pl.DataFrame]) -> WindowPart:
        """The part ``to_frames`` stored."""
        columns = {name: frames["columns"].get_column(name).to_numpy() for name in frames["columns"].columns}
        if columns:
            columns.setdefault("q", np.zeros(0))
        vocab: dict[str, list[str]] = {}
        for (name,), rows in frames["vocab"].sort("i").group_by("name", maintain_order=True):
            vocab[str(name)] = rows.get_column("value").to_list()
        for name in ("label", "kind", "comm"):
            if columns:
                vocab.setdefault(name, [])
        meta = frames["meta"]
        return cls(
            per=frames["per"],
            late=frames["late"],
            edges=frames["edges"],
            ranks=meta.get_column("rank").to_list(),
            n_groups=int(meta.get_column("n_groups").max() or 0) if meta.height else 0,
            columns=columns,
            vocab=vocab,
        )


def plan_preparation(df: pl.DataFrame, prepare: bool = True, max_rows: int | None = None) -> PreparationPlan:
    """The plan of a windowed preparation of ``df`` (which carries ``row`` and ``_step``). The send/receive pairs are
    found one communicator at a time and the roles from the role rows of batches of whole ranks (``_roles``), so that
    neither holds temporaries over the whole table."""
    pairs = _pairs_by_communicator(df)
    n_comm, n_unissued = df.select(
        COMM_ROW.sum().alias("n"), (COMM_ROW & pl.col("enqueue_ns").is_null()).sum().alias("u")
    ).row(0)
    issue_model = bool(n_comm) and n_unissued == 0
    return PreparationPlan(
        windows=_preparation_windows(df, pairs, PREPARE_ROWS if max_rows is None else max_rows),
        pairs=pairs,
        roles=_roles(df) if prepare else {},
        issue_model=issue_model,
        prepare=prepare,
        next_starts=next_starts(df.lazy(), issue_model).collect(),
    )


COMM_ROW = (pl.col("_step") >= 0) & (pl.col("op") != "compute")  # a communication row of a step
ROLE_BATCH_ROWS = 1 << 18  # rows of whole ranks whose role rows are taken at once (_roles)


def _pairs_by_communicator(df: pl.DataFrame) -> pl.DataFrame:
    """``p2p_pairs`` of ``df``, one communicator at a time (a transfer pairs within its communicator)."""
    p2p = df.select(*_WINDOW_COLUMNS).filter(pl.col("is_p2p"))
    if p2p.height == 0:
        return p2p_pairs(p2p)
    rows = p2p.with_row_index("_i").group_by("comm_id", maintain_order=True).agg("_i").get_column("_i")
    parts = [p2p_pairs(p2p[indices]) for indices in rows.to_list()]
    return pl.concat(parts, how="vertical_relaxed").sort("row")


def _roles(df: pl.DataFrame) -> dict[str, str]:
    """``infer_roles`` of ``df`` (in canonical order: rank first) from the role rows of batches of whole ranks, which
    concatenated in rank order are the whole table's (``role_rows``)."""
    per_rank = df.group_by("rank", maintain_order=True).len().get_column("len").to_numpy()
    ends = np.cumsum(per_rank)
    parts, start = [], 0
    while start < df.height:
        stop = int(
            ends[
                max(
                    np.searchsorted(ends, start + ROLE_BATCH_ROWS, side="right") - 1,
                    np.searchsorted(ends, start, side="right"),
                )
            ]
        )
        parts.append(role_rows(df.slice(start, stop - start).drop("row", "_step")))
        start = stop
    return infer_roles(pl.concat(parts, how="vertical_relaxed") if parts else df.drop("row", "_step"))


def next_starts(rows: pl.LazyFrame, issue_model: bool) -> pl.LazyFrame:
    """``PreparationPlan.next_starts`` of ``rows`` (with ``_step``): per (rank, step), sorted, the start (else issue
    time) of the rank's first operation the replay keeps (communication only under the host-issue model). Those of
    disjoint sets of ranks concatenate (then sort) into their union's."""
    return (
        rows.filter(COMM_ROW if issue_model else pl.col("_step") >= 0)
        .select("rank", "_step", s=pl.coalesce("start_ns", "enqueue_ns"))
        .filter(pl.col("s").is_not_null())
        .group_by("rank", "_step")
        .agg(pl.col("s").min())
        .sort("rank", "_step")
    )


def window_rows(df: pl.DataFrame, plan: PreparationPlan, index: int) -> pl.DataFrame:
    """The rows (and columns) of ``df`` that window ``index`` of ``plan`` prepares: those of its steps, and for the
    first window the rows before the first recovered step."""
    lo, hi = plan.windows[index]
    in_window = pl.col("_step").is_between(lo, hi)
    if index == 0:
        in_window = in_window | (pl.col("_step") < 0)
    return df.select(*_WINDOW_COLUMNS).filter(in_window)


def prepare_window(df: pl.DataFrame, plan: PreparationPlan, index: int) -> WindowPart:
    """Window ``index`` of ``plan`` prepared from ``df``'s rows of its steps (``window_rows``; ``df`` may hold only
    those): matching, the statistics' sums, the replay's columns."""
    w = window_rows(df, plan, index)
    m = match_operations(w, plan.pairs)
    per, late, edges = _window_statistics(w, m)
    columns: dict[str, np.ndarray] = {}
    vocab: dict[str, list[str]] = {}
    if plan.prepare:
        columns, vocab = _prepare_window(w, m, plan.roles, plan.issue_model, plan.after(index))
    return WindowPart(
        per=per,
        late=late,
        edges=edges,
        ranks=w.get_column("rank").unique().to_list(),
        n_groups=int(m.get_column("group").max() or 0) + 1 if m.height else 0,
        columns=columns,
        vocab=vocab,
    )


def _consumed(parts: Iterable[WindowPart]) -> Iterator[WindowPart]:
    """``parts`` one at a time, a list's emptied as it goes (a part is dropped once read)."""
    if not isinstance(parts, list):
        yield from parts
        return
    parts.reverse()
    while parts:
        yield parts.pop()


def _numbered(part: WindowPart, vocab: dict[str, dict[str, int]], offset: int) -> dict[str, np.ndarray]:
    """A window part's replay columns with its matched groups numbered from ``offset`` and its strings by their ids in
    the job's vocabularies (``vocab``, extended with strings not seen before); the part keeps none."""
    cols = part.columns
    part.columns = {}
    cols["group"] = np.where(cols["group"] >= 0, cols["group"] + offset, -1)
    for name, ids in vocab.items():
        remap = np.array([0, *(ids.setdefault(v, len(ids) + 1) for v in part.vocab[name])], np.int32)
        cols[name] = remap[cols[name]]
    return cols


def _window_statistics(w: pl.DataFrame, m: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """One window's share of the per-rank statistics: per (step, rank) lateness, waiting, busy time, span and
    compute; per rank the sums behind the mean lateness and the waiting; per (waiter, waited-for) the waiting
    (each waiting member of a collective -> its last arriver). Sums and counts: windows add up."""
    joined = w.select("row", "rank", "_step", "op", "start_ns", "end_ns").join(
        m.select("row", "group", "lateness_ns", "wait_ns", "arrival_ns"), on="row"
    )
    in_group = joined.filter(pl.col("group") >= 0)
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
    per = span.join(per, on=["_step", "rank"], how="left").fill_null(0)
    late = in_group.group_by("rank").agg(
        late_sum=pl.col("lateness_ns").sum(), late_n=pl.len(), wait_sum=pl.col("wait_ns").sum()
    )
    last_of = in_group.sort("arrival_ns").group_by("group").agg(waited_for=pl.col("rank").last())
    edges = (
        in_group.join(last_of, on="group")
        .filter((pl.col("rank") != pl.col("waited_for")) & (pl.col("wait_ns") > 0))
        .group_by("rank", "waited_for")
        .agg(wait_ns=pl.col("wait_ns").sum(), count=pl.len())
    )
    return per, late, edges


def _prepare_window(
    w: pl.DataFrame, m: pl.DataFrame, roles: dict[str, str], issue_model: bool, after: pl.DataFrame
) -> tuple[dict[str, np.ndarray], dict[str, list[str]]]:
    """The replay's per-event columns of one window of whole steps (numpy; strings as ids, from 1, of the window's
    own vocabularies, returned beside them). ``after``: per rank, the start of its next operation after the window."""
    # Only the columns the replay reads: the table's other columns (lists of members, names) would be
    # carried through every join and sort below.
    ev = w.select(*REPLAY_COLUMNS).filter(pl.col("_step") >= 0)
    ev = ev.join(m.select("row", "group", "last_arrival_ns", "partner_row"), on="row", how="left")
    # Host-issue model when every communication event says when the host enqueued it (profiler
    # evidence); compute rows are then step annotations, not work, and are left out.
    if issue_model:
        ev = ev.filter(pl.col("op") != "compute")
    ev = ev.with_columns(s=pl.coalesce("start_ns", "enqueue_ns"), e=pl.coalesce("end_ns", "start_ns", "enqueue_ns"))
    ev = ev.filter(pl.col("s").is_not_null()).sort("rank", "_step", "s", "row")
    # A compute row that spans the rank's next operation (here or in a later window) is an annotation (a
    # profiler's step span), not work the rank did before it. A rank's last row of the trace has no next
    # operation and is kept (no sentinel time: one added to the slack would wrap around).
    following = pl.col("s").shift(-1).over("rank").fill_null(pl.col("_next"))
    ev = ev.join(after, on="rank", how="left", maintain_order="left").filter(
        (pl.col("op") != "compute") | following.is_null() | (pl.col("e") <= following + WAIT_CLOCK_SLACK_NS)
    )
    # What makes two ranks' operations "the same" for the what-if reference: the signature
    # (role, op, size); when sizes are unknown, the operation's name as the source gave it.
    role = pl.col("comm_id").replace_strict(roles, default="other", return_dtype=pl.String)
    ev = ev.with_columns(
        label=pl.when(pl.col("bytes").is_not_null())
        .then(pl.concat_str([role, pl.col("op"), pl.col("bytes").cast(pl.String)], separator="|"))
        .otherwise(pl.concat_str([role, pl.col("op"), pl.col("comm_name").fill_null("")], separator="|")),
    ).with_columns(occurrence=pl.col("s").rank("ordinal").over("rank", "_step", "label"))
    # A rank's program in a step: its sequence of operations. Ranks running the same program (a
    # pipeline stage's data- and tensor-parallel peers) are the best reference for each other.
    programs = ev.group_by("rank", "_step").agg(program=pl.col("label").str.join("\n").hash())
    ev = ev.join(programs, on=["rank", "_step"], how="left", maintain_order="left")
    role_op = pl.concat_str(
        [role, pl.when(pl.col("is_p2p")).then(pl.lit("send/recv")).otherwise(pl.col("op"))], separator=" "
    )
    ev = ev.with_columns(
        kind=pl.when(pl.col("op") == "compute")
        .then(pl.coalesce(pl.col("comm_name"), pl.lit("compute")))
        .otherwise(role_op),
        comm=pl.col("comm_id").cast(pl.String).fill_null(""),
    )
    cols = {
        "row": ev.get_column("row").to_numpy(),
        "rank": ev.get_column("rank").to_numpy(),
        "step": ev.get_column("_step").to_numpy(),
        "s": ev.get_column("s").to_numpy(),
        "e": ev.get_column("e").to_numpy(),
        "q": ev.get_column("enqueue_ns").to_numpy().astype(np.float64) if issue_model else np.zeros(0),
        "group": ev.get_column("group").fill_null(-1).to_numpy(),
        "is_p2p": ev.get_column("is_p2p").fill_null(False).to_numpy(),
        "last_arrival": ev.get_column("last_arrival_ns").to_numpy().astype(np.float64),
        "partner_row": ev.get_column("partner_row").fill_null(-1).to_numpy(),
        "occurrence": ev.get_column("occurrence").to_numpy(),
        "program": ev.get_column("program").to_numpy(),
        "is_compute": (ev.get_column("op") == "compute").to_numpy(),
    }
    vocab: dict[str, list[str]] = {}
    for name in ("label", "kind", "comm"):
        ids: dict[str, int] = {}
        cols[name] = _vocab_ids(ev.get_column(name), ids).astype(np.int32)
        vocab[name] = list(ids)
    return cols, vocab


def _vocab_ids(values: pl.Series, vocab: dict[str, int]) -> np.ndarray:
    """Per row, the id (1, 2, ...) of its string in ``vocab``, extended with strings not seen before."""
    values = values.fill_null("\x00")
    for v in values.unique(maintain_order=True).to_list():
        vocab.setdefault(v, len(vocab) + 1)
    return values.replace_strict(vocab, return_dtype=pl.Int64).to_numpy()


def _names(vocab: dict[str, int]) -> np.ndarray:
    """The strings of a vocabulary (``_vocab_ids``) by id, as an object array: indexed by ids, equal strings are
    one object (a pointer per event, not a string)."""
    names = np.empty(len(vocab) + 1, dtype=object)
    names[0] = ""
    for value, i in vocab.items():
        names[i] = value
    return names


@dataclass(frozen=True)
class _Candidate:
    """A subset that may be a culprit: its ranks, and which atoms' durations and gaps are its own."""

    ranks: set[int]
    work: np.ndarray
    gap: np.ndarray


@dataclass(frozen=True)
class _Scenario:
    """Which atoms' events keep their observed gaps (``gap``) and durations (``work``); the rest are ideal."""

    work: np.ndarray
    gap: np.ndarray


def _name_order(name: str) -> tuple[int, int, str]:
    """Where a candidate or subset (``kind=value``) comes among equals: by kind (``SUBSET_KINDS``), then its value
    (numbers by number). Equal costs are then ordered the same way in every run, whatever order they were found in."""
    kind, _, value = name.partition("=")
    position = SUBSET_KINDS.index(kind) if kind in SUBSET_KINDS else len(SUBSET_KINDS)
    return position, int(value) if value.isdigit() else -1, value


def _noise_threshold(singles: np.ndarray, step: float, min_gain: float) -> float:
    """Saving a culprit must exceed: well above what making any one rank typical saves.

    Making a healthy rank typical trims its jitter; how much that saves, over the job's ranks,
    is the job's own noise (median and spread). ``min_gain`` (a share of the step) is the
    resolution below which nothing is named.
    """
    if singles.size == 0:
        return min_gain * step
    med = float(np.median(singles))
    spread = 1.4826 * float(np.median(np.abs(singles - med)))
    return max(med + NOISE_MULTIPLE * spread, NOISE_MULTIPLE * max(med, 0.0), min_gain * step)


def _paired_bar(
    saving: np.ndarray, siblings: list[np.ndarray], step: float, min_gain: float
) -> tuple[float, np.ndarray]:
    """What a subset with only one or two siblings (two pipeline stages, two DP replicas) must save:
    on average, and in each step (for its consistency).

    With one or two siblings there is no spread to measure among them (a median plus robust spreads
    of one value is that value), and a fixed multiple of the sibling's saving (three times, before)
    is no measure of noise: too lax when the sibling happened to save nothing, too strict when a
    hiccup made it save a few ms of a large step. The steps are the replicates instead: per step, the
    candidate's saving is paired with the largest of its siblings' (what making an equally large part
    of the job typical trims that step). On average it must exceed the siblings' mean by
    ``NOISE_MULTIPLE`` standard errors of the paired difference over steps (a paired test against the
    job's own per-step noise); in a step, the siblings' saving of that step.
    ``saving`` and ``siblings``: per step, what making each typical saves; ``min_gain`` a share of ``step``.
    """
    other = np.max(np.stack(siblings), axis=0)
    se = float((saving - other).std(ddof=1)) / np.sqrt(saving.size)
    floor = min_gain * step
    return max(float(other.mean()) + NOISE_MULTIPLE * se, floor), np.maximum(other, floor)


def _excess(arrays: dict[str, np.ndarray], work: np.ndarray, gap: np.ndarray) -> np.ndarray:
    """Per step: how much longer the masked atoms' durations and gaps were than the median's (from the
    per-atom, per-step sums: nothing per event)."""
    return arrays["atom_excess_work"][work].sum(axis=0) + arrays["atom_excess_gap"][gap].sum(axis=0)


def _rank_excess(
    arrays: dict[str, np.ndarray], extra: np.ndarray, ranks: set[int], exclude: set[int]
) -> tuple[np.ndarray, float]:
    """A set of ranks' excess over the typical rank outside it, per step, and the noise of that.

    The reference is the ranks outside the set (and outside ``exclude``, the culprits already
    named): per step, their median total excess, and the robust spread of a rank's excess around
    it, pooled over ranks and steps. Jitter then sums to about zero and a step in which everyone
    ran slower says nothing; and when half the job is slow (one of two pipeline stages, one of two
    DP groups) the healthy half alone is the reference, where a median over every rank would sit
    between the two halves and read the slowness itself as noise.
    Returns (excess per step, standard deviation of that excess for a healthy set of this size).
    """
    per = arrays["rank_excess"]
    outside = ~np.isin(arrays["rank_ids"], list(ranks | exclude))
    if outside.sum() < 2:
        outside = ~np.isin(arrays["rank_ids"], list(ranks))
    if outside.sum() < 1 or not ranks:
        return extra, 0.0
    # In a pipeline without compute rows, a member is compared with the ranks outside the set that
    # run its stage's program when there are two or more (a victim of a slow stage-1 TP link in
    # stage 0 against stage 0's other replicas), else with every rank outside the set (a whole
    # stage against the other stages, made comparable by replay_inputs._StageReference).
    stage = arrays.get("rank_stage")
    member = np.isin(arrays["rank_ids"], list(ranks))
    refs: list[tuple[int, np.ndarray]] = []
    for s in np.unique(stage[member]) if stage is not None else []:
        same = outside & (stage == s)
        refs.append((int((member & (stage == s)).sum()), same if same.sum() >= 2 else outside))
    if not refs:
        refs = [(len(ranks), outside)]
    k, m = len(ranks), min(int(ref.sum()) for _, ref in refs)
    if k == 1:
        typical = sum(k_s * np.median(per[ref], axis=0) for k_s, ref in refs)
        resid = np.concatenate([per[ref] - np.median(per[ref], axis=0)[None, :] for _, ref in refs])
        spread = 1.4826 * float(np.median(np.abs(resid - np.median(resid))))
        # The rank's own jitter plus that of the reference (a median of m ranks varies about 1.57 / m
        # times one rank's variance).
        return extra - typical, spread * np.sqrt(1 + 1.57 / m)
    # A set of k ranks against sets of k ranks drawn from the reference (with replacement; a fixed
    # seed keeps reports reproducible): per step, the median of such a set's total excess is the
    # typical total, and the robust spread of those totals, pooled over steps, its noise. k times
    # the median rank is not the typical total when the noise is skewed (heavy-tailed hiccups: a
    # few operations many times longer): a sum of k ranks holds about k times the mean, above k
    # times the median, and 16 ranks of a CP group of a job with no straggler once passed as
    # slow; the spread of sums also carries the tail that one rank's robust spread leaves out.
    rng = np.random.default_rng(0)
    typical = np.zeros(per.shape[1])
    variance = 0.0
    for k_s, ref in refs:
        pool = per[ref]
        sums = pool[rng.integers(0, pool.shape[0], size=(NULL_DRAWS, k_s))].sum(axis=1)  # draws x steps
        centre = np.median(sums, axis=0)
        typical = typical + centre
        variance += (1.4826 * float(np.median(np.abs(sums - centre[None, :])))) ** 2
    # Plus the uncertainty of the reference itself (about 1.57 k / m of a set's variance).
    return extra - typical, float(np.sqrt(variance * (1 + 1.57 * k / m)))


def _significant(extra: np.ndarray, pooled_sd: float = 0.0) -> bool:
    """Excess above zero by more than noise (any positive one when one step).

    With ``pooled_sd`` (what a set of healthy ranks of the same size shows in a step): the median
    and the mean over steps against it (a few outlier steps neither make a culprit nor, when the
    rest are steadily slow, hide one; a straggler that starts late in the trace still counts),
    and the median against the set's own robust spread over steps: that catches noise shared by
    the members of a group (a TP group's collectives take one time for all), which the per-rank
    spread does not see. Without it (a communicator): the mean against the subset's own spread
    over steps.
    """
    if extra.size < 2:
        return bool(extra.sum() > 0)
    se = float(extra.std(ddof=1)) / np.sqrt(extra.size)
    if pooled_sd > 0:
        # Robust over steps: one odd step (the first, holding set-up work; a straggler that
        # starts later) must not hide a steady excess.
        med = float(np.median(extra))
        robust_se = 1.4826 * float(np.median(np.abs(extra - med))) / np.sqrt(extra.size)
        steady = extra.size < 3 or med > TEMPORAL_SE * robust_se
        bar = NOISE_MULTIPLE * 1.25 * pooled_sd / np.sqrt(extra.size)
        return steady and med > bar and float(extra.mean()) > bar
    return float(extra.mean()) > max(NOISE_MULTIPLE * se, 0.0)


def _steadily_slow(arrays: dict[str, np.ndarray], rank: int, exclude: set[int], n_tests: int) -> bool:
    """Whether one rank's own excess is in the upper tail of healthy ranks' in more steps than chance allows.

    The magnitude tests (_significant, the saving's bar) measure noise by robust spreads, which leave the
    tail out; with heavy-tailed hiccups (a few operations many times longer) on many ranks, some healthy
    rank draws large hiccups in three steps of five and passes them (64 ranks, 1 + 0.1 x Pareto(1.5) on 2%
    of operations: a rank saved 1.05 ms against a 0.78 ms bar). A straggler is slow in (nearly) every
    step. Per step, the rank's excess is compared with the upper decile of the reference ranks' (those
    outside it and the culprits already named, centred on each step's median and pooled over steps, so
    the tail is the job's own, measured); under exchangeable healthy ranks the count of steps above it is
    Binomial(steps, 0.1), and the rank passes when that count is improbable for every one of the
    ``n_tests`` ranks tried (Bonferroni, family-wise ``FAMILY_ALPHA``). When even every step above the
    decile would not be improbable (too few steps for the number of ranks) the test cannot decide and
    the magnitude tests alone do.
    """
    ids, per = arrays["rank_ids"], arrays["rank_excess"]
    steps = per.shape[1]
    if steps < 2 or rank not in set(ids.tolist()) or n_tests * TAIL_SHARE**steps >= FAMILY_ALPHA:
        return True
    outside = ~np.isin(ids, [rank, *exclude])
    if outside.sum() < 2:
        outside = ids != rank
    reference = per[outside]
    if reference.size * TAIL_SHARE < 1:
        return True  # too few values to place an upper decile
    centre = np.median(reference, axis=0)
    cut = float(np.quantile((reference - centre[None, :]).ravel(), 1.0 - TAIL_SHARE))
    above = int((per[int(np.flatnonzero(ids == rank)[0])] - centre > cut).sum())
    p = sum(math.comb(steps, j) * TAIL_SHARE**j * (1 - TAIL_SHARE) ** (steps - j) for j in range(above, steps + 1))
    return n_tests * p < FAMILY_ALPHA


def _slow_without_its_slowest(arrays: dict[str, np.ndarray], ranks: set[int], exclude: set[int]) -> bool:
    """Whether a set of ranks is still slower than noise without its slowest member.

    A group is named for a slowness its members share (a DP group's compute, a stage's backward).
    One slow rank makes every group that holds it slower (a tensor-parallel index across a 16-GPU
    job, half of its ranks, with rank 1 2-8% slow, "saved" 2.4 ms a step while the rank's fault cost
    0.9): if the rank itself does not pass, the group is not the answer either.
    """
    ids, per = arrays["rank_ids"], arrays["rank_excess"]
    members = sorted(r for r in ranks if r in set(ids.tolist()))
    if len(members) < 2:
        return True
    total = {r: math.fsum(per[int(np.flatnonzero(ids == r)[0])]) for r in members}
    slowest = min(members, key=lambda r: (-total[r], r))  # equal totals: the lowest rank
    rest = set(members) - {slowest}
    rows = np.isin(arrays["atom_rank"], list(rest))
    # The slowest member is left out of the reference as well: it is not a healthy rank.
    extra, pooled = _rank_excess(arrays, _excess(arrays, rows, rows), rest, exclude | {slowest})
    return _significant(extra, pooled)


def _rest_is_slow(
    arrays: dict[str, np.ndarray],
    top: _Candidate,
    work: np.ndarray,
    gap: np.ndarray,
    chosen: _Candidate,
    part_rate: float,
) -> bool:
    """Whether the ranks of the top that a part of it (``work``, ``gap``: its atoms) leaves out share its slowness:
    their own excess, against the ranks outside the top, is above noise (as in point 3) and, per rank, at least
    half the part's (``part_rate``: the measure by which a later round takes a second straggler hidden behind the
    first). Whole ranks only, as the reference is: a rank with some atoms in the part (one end of a slow link) is
    the part's, and a rank's other atoms compared with whole ranks outside would read the part's key shared with
    them (a slow link's collectives against the same collectives of healthy groups) as their own excess.

    A part explains the top only when the rest of the top is not as slow: a slow rank and a slow link leave the
    healthy ranks of their stage. When the rest is as slow, the slowness is the top's (point 4 asks the same of a
    group without its slowest member), and the top is the answer: the four ranks of a replica computing x1.05
    under 5% noise were named as two of them, whose union came within noise of the replica's saving while the
    other two were nearly as slow.
    """
    ranks = top.ranks - set(np.unique(arrays["atom_rank"][work | gap]).tolist()) - chosen.ranks
    if not ranks:
        return False
    rows = np.isin(arrays["atom_rank"], list(ranks))
    extra, pooled = _rank_excess(
        arrays, _excess(arrays, top.work & rows, top.gap & rows), ranks, chosen.ranks | top.ranks
    )
    return float(extra.mean()) / len(ranks) >= 0.5 * part_rate and _significant(extra, pooled)


def _first_of_union(
    arrays: dict[str, np.ndarray],
    cands: dict[str, _Candidate],
    passing: dict[str, tuple[float, float, float]],
    savings: dict[str, float],
    top_name: str,
    chosen: _Candidate,
    current: np.ndarray,
    threshold: float,
    rate: dict[str, float],
) -> str | None:
    """The first of two or more disjoint culprits that together explain the top, or None.

    No single subset inside the top explains its saving, but several may: a slow rank and a slow
    link of one stage make the stage the top (it holds both). Passing subsets strictly inside the
    top, by saving, each disjoint from those taken, are taken until their union explains the top
    as one subset would (its saving short of the top's by no more than noise in the rest of the
    top) while holding fewer of the top's operations than the top itself (else the top is the
    simpler answer: a slow stage, not its groups one by one). The largest is named now; the
    others, which passed in this round, are found in the next rounds once it is removed.
    """
    top = cands[top_name]
    parts = [
        n
        for n in sorted(passing, key=lambda n: (-savings[n], _name_order(n)))
        if n != top_name
        and not (cands[n].work & ~top.work).any()
        and not (cands[n].gap & ~top.gap).any()
        and (cands[n].work.any() or cands[n].gap.any())
    ]
    taken: list[str] = []
    work, gap = np.zeros_like(top.work), np.zeros_like(top.gap)
    for n in parts:
        c = cands[n]
        if (c.work & work).any() or (c.gap & gap).any() or (c.ranks & {r for m in taken for r in cands[m].ranks}):
            continue
        taken.append(n)
        work, gap = work | c.work, gap | c.gap
        if len(taken) == 1:
            continue  # one part alone was already weighed against the top
        union = _run(arrays, [_Scenario(~(work | chosen.work), ~(gap | chosen.gap))])[0]
        saving = float((current - union).mean())
        atoms = (top.work | top.gap) & ~np.isin(arrays["atom_rank"], list(chosen.ranks))
        rest = atoms & ~(work | gap)
        allowance = max(np.sqrt(np.unique(arrays["atom_rank"][rest]).size) * threshold, passing[top_name][2])
        # Per rank of the union, its parts' excess (the parts share no rank).
        union_rate = sum(rate[m] * len(cands[m].ranks - chosen.ranks) for m in taken) / max(
            len({r for m in taken for r in cands[m].ranks} - chosen.ranks), 1
        )
        if (
            rest.any()
            and saving >= savings[top_name] - allowance
            and not _rest_is_slow(arrays, top, work, gap, chosen, union_rate)
        ):
            return taken[0]
        if len(taken) >= 3:
            break
    return None


TIMED = pl.col("start_ns").is_not_null() & pl.col("end_ns").is_not_null()
NO_STEP = "insufficient: no training step could be recovered from the input (shorter than one step?)"


def _insufficient(df: pl.DataFrame) -> str | None:
    """Why the evidence cannot answer who is slow, or None when it can."""
    n_timed, n_ranks = df.select(TIMED.sum().alias("n"), pl.col("rank").filter(TIMED).n_unique()).row(0)
    return insufficient(n_timed, n_ranks)


def insufficient(n_timed: int, n_ranks: int) -> str | None:
    """Why evidence of ``n_timed`` timed operations on ``n_ranks`` ranks cannot answer who is slow, or None."""
    if n_timed == 0:
        return (
            "insufficient: the evidence has no operation timings (e.g. Flight Recorder dumps record "
            "what was issued, not when it ran), so it cannot say who is slow"
        )
    if n_ranks < 2:
        return "insufficient: timings of a single rank; a straggler shows only against its peers"
    return None


@dataclass
class JobFacts:
    """What the report needs of the whole table beside the windows' parts: whether the evidence can answer, where
    the steps came from, and the ranks' parallel coordinates (given by the input, or inferred from its structure
    when it gives none)."""

    evidence: str | None
    step_source: str
    coords: list[str]
    rank_coord: pl.DataFrame | None
    infer: bool  # the input gives no coordinate column
    inferred: pl.DataFrame | None  # infer_coordinates, when infer and the evidence has timings

    def to_stored(self) -> tuple[dict, dict[str, pl.DataFrame]]:
        """The facts as a JSON document and frames (to store between a run's planning and its merge)."""
        doc = {"evidence": self.evidence, "step_source": self.step_source, "coords": self.coords, "infer": self.infer}
        frames = {
            name: f for name, f in (("rank_coord", self.rank_coord), ("inferred", self.inferred)) if f is not None
        }
        return doc, frames

    @classmethod
    def from_stored(cls, doc: dict, frames: dict[str, pl.DataFrame]) -> JobFacts:
        """The facts ``to_stored`` gave."""
        return cls(
            evidence=doc["evidence"],
            step_source=doc["step_source"],
            coords=list(doc["coords"]),
            rank_coord=frames.get("rank_coord"),
            infer=bool(doc["infer"]),
            inferred=frames.get("inferred"),
        )


def prepare_table(table: pa.Table | pl.DataFrame, use_labels: bool = True) -> tuple[pl.DataFrame, JobFacts]:
    """The operations table with its row index (``row``) and steps (``_step``), and the job's facts."""
    df = table if isinstance(table, pl.DataFrame) else pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)
    df = canonical_order(df.select([c for c in TABLE_COLUMNS if c in df.columns]))
    df = df.with_row_index("row").with_columns(pl.col("row").cast(pl.Int64))
    if df.height == 0:
        raise ValueError("no operations to analyse")
    evidence = _insufficient(df)
    df, step_source = _with_steps(df, use_labels)
    if evidence is None and not df.select((pl.col("_step") >= 0).any()).item():
        # Too little of the job to find a step (a prefix shorter than one iteration): nothing to replay.
        evidence = NO_STEP
    coords = [
        c for c in COORDS if c in df.columns and df.get_column(c).null_count() == 0 and df.get_column(c).n_unique() > 1
    ]
    given = [c for c in COORDS if c in df.columns and df.get_column(c).null_count() < df.height]
    facts = JobFacts(
        evidence=evidence,
        step_source=step_source,
        coords=coords,
        rank_coord=df.group_by("rank").agg([pl.col(c).first() for c in coords]) if coords else None,
        infer=not given,
        # None in the input (raw profiler logs): from the structure of the communicators, if it decides.
        inferred=infer_coordinates(df) if not given and evidence is None else None,
    )
    return df, facts


def analyse_stragglers(
    table: pa.Table | pl.DataFrame, use_labels: bool = True, min_gain: float = 0.005, max_culprit_groups: int = 3
) -> StragglerReport:
    """Straggler report for an operations table (see module doc)."""
    df, facts = prepare_table(table, use_labels)
    # Window by window of whole steps: matching, the per-rank statistics' sums and the replay's per-event
    # columns; what must be global (the send/receive pairs, the roles, which model of the host) first.
    plan = plan_preparation(df, prepare=facts.evidence is None)
    # Each window prepared as the merge reaches it: one window's columns at a time, never every window's; the
    # table is let go once the last window is prepared.
    parts = _prepared(df, plan)
    del df
    return report_from_windows(facts, plan, parts, min_gain, max_culprit_groups)


def _prepared(df: pl.DataFrame, plan: PreparationPlan) -> Iterator[WindowPart]:
    for i in range(len(plan.windows)):
        yield prepare_window(df, plan, i)


def report_from_windows(
    facts: JobFacts,
    plan: PreparationPlan,
    parts: Iterable[WindowPart],
    min_gain: float = 0.005,
    max_culprit_groups: int = 3,
) -> StragglerReport:
    """The straggler report from the job's facts and its windows' parts (``prepare_window``, in window order; the
    parts are consumed): the merge of a windowed analysis."""
    evidence, step_source = facts.evidence, facts.step_source
    # The windows one at a time, in window order: their statistics' sums kept, their replay columns prepared
    # (``ReplayInputs.add``) with their groups and strings numbered across the job, then dropped.
    vocab: dict[str, dict[str, int]] = {"label": {}, "kind": {}, "comm": {}}
    ranks: set[int] = set()
    pers, lates, edge_parts = [], [], []
    inputs = ReplayInputs(plan.issue_model) if evidence is None else None
    offset = 0
    for part in _consumed(parts):
        ranks.update(part.ranks)
        pers.append(part.per)
        lates.append(part.late)
        edge_parts.append(part.edges)
        if part.columns:
            columns = _numbered(part, vocab, offset)
            if inputs is not None:
                inputs.add(columns)
            del columns
        offset += part.n_groups
    ranks_all = sorted(ranks)

    # Per (step, rank): lateness, waiting, time outside communication.
    per = pl.concat(pers).sort("_step", "rank")
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
    late_stats = (
        pl.concat(lates)
        .group_by("rank")
        .agg(pl.col("late_sum", "late_n", "wait_sum").sum())
        .select(
            "rank",
            mean_lateness_ms=pl.col("late_sum") / pl.col("late_n") / 1e6,
            waiting_ms=pl.col("wait_sum") / 1e6,
        )
    )
    rank_stats = (
        rank_stats.join(late_stats, on="rank", how="left")
        .with_columns(pl.col("mean_lateness_ms", "waiting_ms").fill_null(0.0))
        .sort(["straggler_index", "rank"], descending=[True, False])
    )
    index_of = dict(
        zip(rank_stats.get_column("rank").to_list(), rank_stats.get_column("straggler_index").to_list(), strict=True)
    )

    # Causal waiting: each waiting member -> the last arriver of that instance.
    edges = (
        pl.concat(edge_parts)
        .group_by("rank", "waited_for")
        .agg(wait_ms=pl.col("wait_ns").sum() / 1e6, count=pl.col("count").sum().cast(pl.UInt32))
        .sort(["wait_ms", "rank", "waited_for"], descending=[True, False, False])
        .head(50)
        .rename({"rank": "waiter"})
    )
    del pers, lates, edge_parts
    # What-if replay: observed, ideal, and one subset's slowness restored or removed at a time.
    n_ev = inputs.n if inputs is not None else 0
    observed = inputs.observed_times() if n_ev and inputs is not None else np.zeros(0)
    if evidence is None and (observed.size == 0 or float(observed.sum()) <= 0):
        evidence = "insufficient: no step with timed operations on two or more ranks"
    coords, rank_coord = facts.coords, facts.rank_coord
    coordinates = "input" if coords else "none"
    if facts.infer and evidence is None:
        inferred = facts.inferred
        coords = [c for c in COORDS if inferred is not None and c in inferred.columns and inferred[c].n_unique() > 1]
        if inferred is not None and coords:
            rank_coord, coordinates = inferred.select("rank", *coords), "inferred"
    subsets: list[tuple[str, set[int]]] = [(f"rank={r}", {r}) for r in ranks_all]
    if rank_coord is not None:
        for c in coords:
            for value, grp in sorted(rank_coord.group_by(c), key=lambda kv: kv[0][0]):
                subsets.append((f"{c.removesuffix('_rank')}={value[0]}", set(grp.get_column("rank").to_list())))
    report_kwargs: dict = {}
    if evidence is not None or n_ev == 0:
        subsets = []
    arrays: dict = {}
    if subsets and inputs is not None:
        stage_of_rank = None
        if rank_coord is not None and "pp_rank" in rank_coord.columns:
            # Each rank's pipeline stage (-1 for a rank without one).
            stage_of_rank = dict(zip(*(rank_coord.get_column(c).to_list() for c in ("rank", "pp_rank")), strict=True))
        arrays = inputs.finish(stage_of_rank)
        comm_names, kind_names = _names(vocab["comm"]), _names(vocab["kind"])
        arrays["atom_comm"] = comm_names[arrays.pop("atom_comm_id")]
        arrays["atom_kind"] = kind_names[arrays.pop("atom_kind_id")]
        alone = {str(comm_names[c]) for c in arrays.pop("alone")}
    del inputs
    n_atoms = int(arrays["atom_count"].size) if arrays else 0
    everything, nothing = np.ones(n_atoms, bool), np.zeros(n_atoms, bool)
    kinds = sorted({str(k) for k in arrays["atom_kind"]}) if arrays else []
    gap_kind = "compute (between communication)" if arrays and arrays["gaps_are_compute"] else "launch gaps"
    # A candidate: ranks (all their gaps and durations) or a communicator (its transfers only: a
    # slow link slows every member's operations on it, none of their compute).
    cands: dict[str, _Candidate] = {}
    for name, members in subsets:
        m = np.isin(arrays["atom_rank"], list(members))
        cands[name] = _Candidate(members, m, m)
    if subsets:
        comm_ids = arrays["atom_comm"]
        for comm in np.unique(comm_ids[arrays["atom_matched"]]):
            m = arrays["atom_matched"] & (comm_ids == comm)
            members = set(np.unique(arrays["atom_rank"][m]).tolist())
            if len(members) > 1:
                cands[f"comm={comm}"] = _Candidate(members, m, nothing)
        # Communicators are culprit candidates only when their transfers were slower than jitter,
        # and when something else says what they should take: see ReplayInputs._comms_without_peers.
        for name in [n for n in cands if n.startswith("comm=")]:
            if name.removeprefix("comm=") in alone or not _significant(_excess(arrays, cands[name].work, nothing)):
                del cands[name]
    names = list(cands)
    if subsets:
        kind_masks = {k: arrays["atom_kind"] == k for k in kinds}
        comp = arrays["atom_compute"] | ~arrays["atom_matched"]
        base = [_Scenario(everything, everything), _Scenario(nothing, nothing)]
        restore = [_Scenario(cands[n].work, cands[n].gap) for n in names]
        remove = [_Scenario(~cands[n].work, ~cands[n].gap) for n in names]
        kind_restore = [_Scenario(kind_masks[k], nothing) for k in kinds] + [_Scenario(nothing, everything)]
        times = _run(arrays, base + restore + remove + kind_restore)
        actual, ideal = times[0], times[1]
        mean_ideal = replay_module.column_times(arrays, "mean_gap", "mean_work", "start_offset")
        nc = len(names)
        t_restore = dict(zip(names, times[2 : 2 + nc], strict=True))
        t_remove = dict(zip(names, times[2 + nc : 2 + 2 * nc], strict=True))
        t_kind = dict(zip([*kinds, gap_kind], times[2 + 2 * nc :], strict=True))
    else:
        actual = ideal = mean_ideal = observed
        t_restore, t_remove, t_kind = {}, {}, {}
    total_actual, total_ideal = float(actual.sum()), float(ideal.sum())
    excess = max(total_actual - total_ideal, 1e-9)

    def subset_entry(name: str, t_in: np.ndarray, t_out: np.ndarray | None, members: set[int] | None) -> dict:
        entry = {
            "subset": name.split("=", 1)[-1],
            "slowdown_ratio": float(t_in.sum()) / total_ideal if total_ideal > 0 else 1.0,
            "share": (float(t_in.sum()) - total_ideal) / excess,
        }
        if t_out is not None:
            entry["gain_without"] = total_actual / float(t_out.sum()) if float(t_out.sum()) > 0 else 1.0
        if members is not None:
            entry["ranks"] = sorted(members)
        return entry

    attribution: dict[str, list[dict]] = {
        "rank": [],
        "dp": [],
        "pp": [],
        "tp": [],
        "cp": [],
        "comm": [],
        "op_kind": [],
    }
    for name in names:
        attribution[name.split("=", 1)[0]].append(
            subset_entry(name, t_restore[name], t_remove[name], cands[name].ranks)
        )
    for k, t in t_kind.items():
        attribution["op_kind"].append(subset_entry(f"op={k}", t, None, None))
    for kind, entries in attribution.items():
        entries.sort(key=lambda x: (-x["slowdown_ratio"], _name_order(f"{kind}={x['subset']}")))

    # Culprits: remove the subset whose slowness costs the most, then look again with it removed
    # (a rank that only waited for it saves nothing any more), while the saving stands out from
    # the job's noise, holds across steps, and the subset's own operations were slower than their
    # peers' by more than jitter (see _excess).
    # A later culprit must already have cost something in the job as observed, or be about as
    # slow (per rank) as the first: once the first culprit is gone, the critical path moves, and a
    # part of the program that is merely a little longer by construction (a first stage holding
    # the embedding) would otherwise "save" time only in that hypothetical job. What a candidate
    # cost in the observed job counts only for its part outside the culprits already named: a
    # group holding a slow link's ranks "cost" the link's time, an effect of the culprit.
    chosen = _Candidate(set(), nothing, nothing)
    groups: list[dict] = []
    current = actual
    observed_cost: set[str] = set()
    first_bar: dict[str, float] = {}
    first_rate = 0.0
    for _ in range(max_culprit_groups if subsets else 0):
        # What of a candidate is still open: a set of ranks counts only its ranks not yet named (a
        # named culprit's ranks carry its effects in their other operations: the members of a slow
        # TP link wait in their gaps), a communicator only its transfers outside the culprits.
        chosen_events = np.isin(arrays["atom_rank"], list(chosen.ranks))
        part: dict[str, _Scenario] = {}
        for n in names:
            c = cands[n]
            outside = ~chosen.work if n.startswith("comm=") else ~chosen_events & ~chosen.work
            part[n] = _Scenario(c.work & outside, c.gap & (~chosen.gap if n.startswith("comm=") else outside))
        open_names = [n for n in names if part[n].work.any() or part[n].gap.any()]
        if not open_names:
            break
        shared = [
            n
            for n in sorted(observed_cost, key=_name_order)
            if (cands[n].work & chosen.work).any() or (cands[n].gap & chosen.gap).any()
        ]
        if shared:
            rest = [_Scenario(~part[n].work, ~part[n].gap) for n in shared]
            for n, t in zip(shared, _run(arrays, rest), strict=True):
                if float((actual - t).mean()) <= first_bar[n]:
                    observed_cost.discard(n)
        own_excess: dict[str, tuple[np.ndarray, float]] = {}
        rate: dict[str, float] = {}  # excess per rank not yet named
        for n in open_names:
            c = cands[n]
            if not n.startswith("comm="):
                # Only the ranks not yet named: a named communicator's members also carry its
                # effects in their gaps (they finish steps later), which are not this set's own.
                own = c.work & ~chosen_events & ~chosen.work
                own_excess[n] = _rank_excess(arrays, _excess(arrays, own, own), c.ranks - chosen.ranks, chosen.ranks)
            else:
                own_excess[n] = (_excess(arrays, c.work & ~chosen.work, c.gap & ~chosen.gap), 0.0)
            rate[n] = float(own_excess[n][0].mean()) / max(len(c.ranks - chosen.ranks), 1)
        if groups:
            # Replay only what may still be named (see above), every group (their siblings set
            # the bar), and a spread sample of single ranks (the job's noise).
            singles_open = [n for n in open_names if n.startswith("rank=")]
            sample = set(singles_open[:: max(1, len(singles_open) // NOISE_SAMPLE)])
            open_names = [
                n
                for n in open_names
                if not n.startswith("rank=") or n in sample or n in observed_cost or rate[n] >= 0.5 * first_rate
            ]
            scen = [_Scenario(~(part[n].work | chosen.work), ~(part[n].gap | chosen.gap)) for n in open_names]
            totals = dict(zip(open_names, _run(arrays, scen), strict=True))
        else:
            totals = {n: t_remove[n] for n in open_names}
        savings = {n: float((current - t).mean()) for n, t in totals.items()}
        singles = np.array([v for n, v in savings.items() if n.startswith("rank=")])
        threshold = _noise_threshold(singles, float(current.mean()), min_gain)
        passing = {}
        for n, v in savings.items():
            c = cands[n]
            extra, pooled = own_excess[n]
            # A candidate must stand out from the others of its kind (the other ranks, DP ranks,
            # stages: itself left out); a group also from single ranks (making a whole group
            # typical trims more jitter than one rank).
            kind = n.split("=", 1)[0]
            siblings = [m for m in savings if m != n and m.split("=", 1)[0] == kind]
            if 1 <= len(siblings) < 3 and current.size >= 2:
                paired = [current - totals[m] for m in siblings]
                bar, step_bar = _paired_bar(current - totals[n], paired, float(current.mean()), min_gain)
            else:
                bar = _noise_threshold(np.array([savings[m] for m in siblings]), float(current.mean()), min_gain)
                step_bar = np.full(current.size, bar)
            if kind != "rank":
                bar, step_bar = max(threshold, bar), np.maximum(step_bar, threshold)
            # Consistent: the saving clears the bar in most steps, not on average only (one
            # step's hiccup of a healthy rank can carry a mean over six steps).
            consistency = float((current - totals[n] > step_bar).mean())
            evident = v > bar and consistency > 0.5 and _significant(extra, pooled)
            if evident and not n.startswith("comm=") and len(c.ranks - chosen.ranks) > 1:
                evident = _slow_without_its_slowest(arrays, c.ranks - chosen.ranks, chosen.ranks)
            elif evident and kind == "rank":
                evident = _steadily_slow(arrays, next(iter(c.ranks)), chosen.ranks, len(ranks_all) - len(chosen.ranks))
            if not groups and evident:
                observed_cost.add(n)
                first_bar[n] = bar
            if groups and n not in observed_cost and rate[n] < 0.5 * first_rate:
                continue
            if evident:
                passing[n] = (float(extra.mean()), consistency, bar)
        if not passing:
            break
        # The biggest saving, then the smallest subset inside it whose own excess explains it
        # (one late rank, not its tensor-parallel group).
        top_name = min(passing, key=lambda n: (-savings[n], _name_order(n)))
        top, best_saving = cands[top_name], savings[top_name]
        # Inside it, a subset explains it when what it saves falls short of the top's saving by no
        # more than noise can account for in the rest of the top: the single-rank bar times the
        # square root of the rest's ranks (their jitter trimmed; independent jitter adds up as a
        # square root), or what a healthy subset of the top's kind saves (the top's own bar). A
        # late rank's TP coordinate group across a 128-GPU job holds 63 healthy ranks beside it; a
        # slow TP link's stage, two healthy ranks and the link's ranks' compute. One end of a slow
        # link alone falls short by far more: it leaves the other end's transfers slow.
        inside = []
        for n in passing:
            c = cands[n]
            if (c.work & ~top.work).any() or (c.gap & ~top.gap).any():
                continue
            rest = ((top.work & ~c.work) | (top.gap & ~c.gap)) & ~chosen_events
            allowance = max(np.sqrt(np.unique(arrays["atom_rank"][rest]).size) * threshold, passing[top_name][2])
            if savings[n] >= best_saving - allowance and not _rest_is_slow(arrays, top, c.work, c.gap, chosen, rate[n]):
                inside.append(n)
        # The smallest by the operations and gaps it restores, not by its ranks: a slow link's
        # communicator restores its transfers only, one end of the link all that rank's work, and
        # on a loaded machine that rank's own noise can bring its saving up to the pair's.
        count = arrays["atom_count"]
        name = min(
            inside,
            key=lambda n: (int(count[cands[n].work].sum() + count[cands[n].gap].sum()), -savings[n], _name_order(n)),
        )
        if name == top_name:
            name = _first_of_union(arrays, cands, passing, savings, top_name, chosen, current, threshold, rate) or name
        consistency = passing[name][1]
        c = cands[name]
        new_members = c.ranks - chosen.ranks
        if not groups:
            first_rate = passing[name][0] / max(len(new_members), 1)
        chosen = _Candidate(chosen.ranks | c.ranks, chosen.work | c.work, chosen.gap | c.gap)
        split = _run(arrays, [_Scenario(c.work & comp, c.gap), _Scenario(c.work & ~comp, nothing)])
        groups.append(
            {
                "group": name,
                "ranks": sorted(new_members, key=lambda r: (-math.fsum(t_restore[f"rank={r}"]), r)),
                "saves_ms_per_step": savings[name] / 1e6,
                "share_of_slowdown": savings[name] * len(current) / excess,
                "consistency": consistency,
                "compute_ratio": float(split[0].sum()) / total_ideal,
                "communication_ratio": float(split[1].sum()) / total_ideal,
                "threshold_ms": threshold / 1e6,
            }
        )
        current = totals[name]
        if name.startswith("comm="):
            # A slow link slows every communicator whose ring crosses it, and the evidence names a
            # communicator, not a hop: the slow transfers of the communicators that hold all of this
            # one's ranks are taken with it (the simulated TP link 4-5 also slows the model-parallel
            # group 0, 1, 4, 5, whose slow all-reduce was later charged to ranks 0 and 1, `dp=0`).
            same = [m for m in names if m.startswith("comm=") and m != name and cands[m].ranks >= c.ranks]
            if same:
                work = chosen.work | np.logical_or.reduce([cands[m].work for m in same])
                chosen = _Candidate(chosen.ranks, work, chosen.gap)
                current = _run(arrays, [_Scenario(~chosen.work, ~chosen.gap)])[0]
    culprits = [r for g in groups for r in g["ranks"]]

    observed_mean = float(observed.mean()) if observed.size else 0.0
    scale = observed_mean / float(actual.mean()) if actual.size and float(actual.mean()) > 0 else 1.0
    ideal_mean = float(mean_ideal.mean()) * scale if mean_ideal.size else 0.0
    healthy_mean = float(ideal.mean()) * scale if ideal.size else 0.0
    estimated = float(current.mean()) * scale if current.size else observed_mean
    slowdown = {
        "observed_step_ms": observed_mean / 1e6,
        "estimated_without_culprits_ms": estimated / 1e6,
        "ideal_step_ms": ideal_mean / 1e6,
        "observed": observed_mean / 1e6,
        "ideal": ideal_mean / 1e6,
        "ratio": observed_mean / ideal_mean if ideal_mean > 0 else 1.0,
        "healthy_step_ms": healthy_mean / 1e6,
        "healthy_ratio": observed_mean / healthy_mean if healthy_mean > 0 else 1.0,
        "without_culprits_ratio": observed_mean / estimated if estimated > 0 else 1.0,
        "replay_error": abs(total_actual - float(observed.sum())) / max(float(observed.sum()), 1.0),
        "steps": int(observed.size),
    }
    by_coordinate: dict[str, dict] = {}
    for name, members in subsets:
        kind, value = name.split("=", 1)
        if kind == "rank":
            continue
        by_coordinate.setdefault(kind, {})[value] = {
            "ranks": sorted(members),
            "slowdown_ratio": total_actual / float(t_remove[name].sum()),
            "restored_ratio": float(t_restore[name].sum()) / total_ideal,
            "mean_arrival_score": math.fsum(index_of.get(m, 0.0) for m in sorted(members)) / len(members),
        }
    # straggler_index: share of step time saved were the rank (or the culprit group holding it) not slow.
    saved = {r: 1.0 - float(t_remove[f"rank={r}"].sum()) / total_actual if t_remove else 0.0 for r in ranks_all}
    for g in groups:
        share = 1.0 - float(t_remove[g["group"]].sum()) / total_actual
        for m in cands[g["group"]].ranks:
            saved[m] = max(saved[m], share)
    ranks_out = []
    for row in rank_stats.iter_rows(named=True):
        t_out = t_remove.get(f"rank={row['rank']}")
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
                "slowdown_ratio_without": total_actual / float(t_out.sum()) if t_out is not None else 1.0,
            }
        )
    ranks_out.sort(key=lambda x: (-x["straggler_index"], -x["arrival_score"], x["rank"]))
    top = (
        per.sort(["score", "rank"], descending=[True, False], maintain_order=True)
        .group_by("_step", maintain_order=True)
        .agg(top_rank=pl.col("rank").first(), top_score=pl.col("score").first())
    )
    top_of = {int(s): (int(r), float(v)) for s, r, v in top.iter_rows()}
    step_ids = arrays["step_ids"].tolist() if n_ev else []
    per_step_out = []
    for i, s in enumerate(step_ids):
        r, v = top_of.get(int(s), (-1, 0.0))
        per_step_out.append(
            {
                "step": int(s),
                "duration_ms": float(observed[i]) / 1e6,
                "ideal_ms": float(ideal[i]) * scale / 1e6,
                "without_culprits_ms": float(current[i]) * scale / 1e6,
                "top_rank": r,
                "top_score": v,
            }
        )
    heatmap = {
        "ranks": ranks_all if t_restore else [],
        "steps": [int(s) for s in step_ids] if t_restore else [],
        "delay_ms": [((t_restore[f"rank={r}"] - ideal) * scale / 1e6).round(3).tolist() for r in ranks_all]
        if t_restore
        else [],
    }
    report_kwargs.update(
        attribution=attribution,
        evidence=evidence or "ok",
        ideal_step_ms=ideal_mean / 1e6,
        heatmap=heatmap,
        coordinates=coordinates,
    )
    return StragglerReport(
        ranks=ranks_out,
        culprits=culprits,
        culprit_groups=groups,
        slowdown=slowdown,
        by_coordinate=by_coordinate,
        waiting_edges=edges.to_dicts(),
        per_step=per_step_out,
        step_source=step_source,
        **report_kwargs,
    )
