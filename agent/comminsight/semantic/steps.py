"""Offline step recovery over an operations table, per-GPU step summaries, and StepID calibration.

``recover_steps(table)`` prepares the communication events (compute rows are left out: steps are
recovered from communication alone), runs the streaming engine over them in chunks, and returns
a ``StepReport``: per-event step ids, per-rank step summaries, job-level steps (earliest start
and latest end over ranks), the method used, and, when the table carries step labels, how well
the recovered steps agree with them.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa

from comminsight.semantic.engine import StepEngine, summaries_frame
from comminsight.semantic.matching import match_operations
from comminsight.semantic.order import canonical_permutation
from comminsight.semantic.roles import OP_CODE, ROLE_CODE, ROLES, infer_roles, roles_from_shape_alone, signatures
from comminsight.semantic.templates import Template


@dataclass(frozen=True)
class StepCalibration:
    """Maps recovered step ids onto the framework's: framework = recovered + offset."""

    offset: int = 0

    @classmethod
    def from_pair(cls, recovered: int, framework: int) -> StepCalibration:
        """The calibration that makes recovered step ``recovered`` read as ``framework``."""
        return cls(offset=int(framework) - int(recovered))

    def apply(self, step: int) -> int:
        return step + self.offset if step >= 0 else step

    def to_json(self) -> str:
        return json.dumps({"offset": self.offset})

    @classmethod
    def from_json(cls, text: str) -> StepCalibration:
        try:
            doc = json.loads(text)
            offset = doc["offset"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"not a step calibration: {exc}") from exc
        if not isinstance(offset, int) or isinstance(offset, bool) or abs(offset) > 1 << 53:
            raise ValueError("step calibration offset must be a whole number")
        return cls(offset=offset)


def save_calibration(path: Path, calibration: StepCalibration | None) -> None:
    """Store a calibration (apply), or remove the stored one when ``calibration`` is None (clear)."""
    path = Path(path)
    if calibration is None:
        path.unlink(missing_ok=True)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(calibration.to_json())
    tmp.replace(path)


def load_calibration(path: Path) -> StepCalibration | None:
    """The stored calibration, or None when none is stored."""
    path = Path(path)
    if not path.exists():
        return None
    if path.stat().st_size > 4096:
        raise ValueError(f"{path}: step calibration file is too large")
    return StepCalibration.from_json(path.read_text())


@dataclass
class StepReport:
    method: str
    methods_by_rank: dict[int, str]
    event_rows: np.ndarray  # row index into the input table
    event_steps: np.ndarray  # recovered step per row (-1: before the first step)
    rank_steps: pl.DataFrame  # one row per (rank, step)
    steps: list[dict] = field(default_factory=list)
    agreement: dict | None = None


def prepare_events(
    table: pa.Table | pl.DataFrame, wait_ns: np.ndarray | None = None, roles: dict[str, str] | None = None
) -> dict[str, np.ndarray]:
    """Communication events as engine arrays, sorted by (rank, start). ``row`` indexes ``table``.

    ``roles``: the communicators' roles when ``table`` is part of a job (else inferred from ``table``)."""
    df = table if isinstance(table, pl.DataFrame) else pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)
    roles = infer_roles(df) if roles is None else roles
    df = df.with_row_index("row").with_columns(
        _wait=pl.Series(wait_ns if wait_ns is not None else np.zeros(df.height, np.int64)).cast(pl.Int64)
    )
    df = df.filter((pl.col("op") != "compute") & pl.col("start_ns").is_not_null())
    df = df.with_columns(pl.col("end_ns").fill_null(pl.col("start_ns")))
    rank = df.get_column("rank").to_numpy()
    start = df.get_column("start_ns").to_numpy()
    d_rank, d_start = np.diff(rank), np.diff(start)
    if np.any(d_rank < 0) or np.any((d_rank == 0) & (d_start < 0)):  # importers usually sort already
        df = df.sort("rank", "start_ns", "row")
    role_code = df.get_column("comm_id").replace_strict(
        {k: ROLE_CODE[v] for k, v in roles.items()}, default=0, return_dtype=pl.Int64
    )
    op_code = df.get_column("op").replace_strict(OP_CODE, default=OP_CODE["other"], return_dtype=pl.Int64)
    nbytes = df.get_column("bytes").fill_null(-1).to_numpy().astype(np.int64)
    role = role_code.to_numpy().astype(np.int64)
    return {
        "rank": df.get_column("rank").to_numpy().astype(np.int64),
        "row": df.get_column("row").to_numpy().astype(np.int64),
        "sig": signatures(role, op_code.to_numpy(), nbytes),
        "role": role,
        "start_ns": df.get_column("start_ns").to_numpy().astype(np.int64),
        "end_ns": df.get_column("end_ns").to_numpy().astype(np.int64),
        "wait_ns": df.get_column("_wait").to_numpy().astype(np.int64),
    }


def run_engine(
    events: dict[str, np.ndarray], engine: StepEngine, chunk_size: int | None = None
) -> tuple[np.ndarray, np.ndarray, list[dict]]:
    """Feed ``events`` in chunks of ``chunk_size`` (all at once when None); return rows, steps, summaries."""
    n = len(events["rank"])
    size = n if not chunk_size else int(chunk_size)
    rows: list[np.ndarray] = []
    steps: list[np.ndarray] = []
    final: list[dict] = []
    for lo in range(0, max(n, 1), max(size, 1)):
        out = engine.feed({k: v[lo : lo + size] for k, v in events.items()})
        rows.append(out["rows"])
        steps.append(out["steps"])
        final.extend(out["final"])
    out = engine.flush()
    rows.append(out["rows"])
    steps.append(out["steps"])
    final.extend(out["final"])
    return np.concatenate(rows), np.concatenate(steps), final


def agreement_with_labels(labels: np.ndarray, recovered: np.ndarray) -> dict:
    """How recovered step ids match true labels: each recovered step votes for its commonest label.

    ``event_agreement``: share of events whose label is their recovered step's label;
    ``one_to_one``: every label got exactly one recovered step and vice versa.
    """
    return agreement_from_counts(label_counts(labels, recovered))


def label_counts(labels: np.ndarray, recovered: np.ndarray) -> pl.DataFrame:
    """Events per (recovered step ``rec``, label ``lab``): what agreement is computed from (sums over parts)."""
    return pl.DataFrame({"rec": recovered, "lab": labels}).group_by("rec", "lab").agg(len=pl.len().cast(pl.Int64))


def agreement_from_counts(counts: pl.DataFrame) -> dict:
    """``agreement_with_labels`` from the (rec, lab, len) counts of every event."""
    labelled = counts.get_column("lab").n_unique()
    total = int(counts.get_column("len").sum())
    pairs = counts.filter(pl.col("rec") >= 0)
    if pairs.height == 0:
        return {"event_agreement": 0.0, "steps_labelled": labelled, "steps_recovered": 0, "one_to_one": False}
    best = pairs.sort("len", descending=True).unique("rec", keep="first")
    agree = int(best.get_column("len").sum())
    one_to_one = best.get_column("lab").n_unique() == best.height == labelled
    return {
        "event_agreement": agree / total,
        "steps_labelled": labelled,
        "steps_recovered": best.height,
        "one_to_one": bool(one_to_one),
    }


def recover_steps(
    table: pa.Table | pl.DataFrame,
    templates: list[Template] | None = None,
    use_templates: bool = True,
    chunk_size: int | None = 1 << 20,
    window: int = 2,
    wait_ns: np.ndarray | None = None,
    calibration: StepCalibration | None = None,
    compute_waits: bool = False,
    roles: dict[str, str] | None = None,
    shape_alone: bool | None = None,
) -> StepReport:
    """Recover steps from the communication in ``table`` (see module doc).

    A part of a job (whole ranks, ``comminsight.analysis.partitioned``) gives the job's ``roles`` and ``wait_ns``, and
    ``shape_alone``: whether the job's roles come from the communicators' shape alone (``roles_from_shape_alone`` of
    the whole job; None: of ``table``).

    The rows are read in one order whatever order ``table`` stores them in (``canonical_order``; ``wait_ns`` is
    in ``table``'s order and goes with its rows): shuffled rows give the same report. ``event_rows`` index
    ``table`` as given.
    """
    df = table if isinstance(table, pl.DataFrame) else pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)
    order = canonical_permutation(df)
    if order is not None:
        df = df[order]
        if wait_ns is not None:
            wait_ns = np.asarray(wait_ns)[order.to_numpy()]
    if wait_ns is None and compute_waits:
        matched = match_operations(df.with_row_index("row").with_columns(pl.col("row").cast(pl.Int64)))
        wait_ns = matched.get_column("wait_ns").to_numpy()
    events = prepare_events(df, wait_ns, roles)
    # Roles read from shape alone: a template must agree with each rank's own period (``StepEngine``).
    engine = StepEngine(
        templates=templates,
        window=window,
        use_templates=use_templates,
        check_templates=roles_from_shape_alone(df) if shape_alone is None else shape_alone,
    )
    rows, steps, final = run_engine(events, engine, chunk_size)
    cal = calibration or StepCalibration()
    methods = {r: st.method or "none" for r, st in engine.ranks.items()}
    method = Counter(methods.values()).most_common(1)[0][0] if methods else "none"
    rank_steps = _rank_frame(final, cal)
    if cal.offset:
        steps = np.where(steps >= 0, steps + cal.offset, steps)
    report = StepReport(
        method=method, methods_by_rank=methods, event_rows=rows, event_steps=steps, rank_steps=rank_steps
    )
    report.steps = job_steps(rank_steps)
    if "step" in df.columns and df.get_column("step").null_count() == 0 and rows.size:
        labels = df.get_column("step").to_numpy()[rows]
        report.agreement = agreement_with_labels(labels, steps)
    if order is not None:  # back to the caller's rows
        report.event_rows = order.to_numpy()[rows]
    return report


def _rank_frame(final: list[dict], cal: StepCalibration) -> pl.DataFrame:
    frame = summaries_frame(final)
    if cal.offset:
        frame = frame.with_columns(
            pl.when(pl.col("step") >= 0).then(pl.col("step") + cal.offset).otherwise(pl.col("step"))
        )
    return frame.sort("step", "rank")


def job_steps(rank_steps: pl.DataFrame) -> list[dict]:
    """Job-level steps: earliest start, latest end over ranks, with per-rank details."""
    if rank_steps.height == 0:
        return []
    roles = [r for r in ROLES if f"comm_{r}_ns" in rank_steps.columns]
    # Build the nested per-rank details column-wise; Python touches each (rank, step) once.
    detail = rank_steps.select(
        "step",
        "start_ns",
        "end_ns",
        rank=pl.col("rank").cast(pl.String),
        duration_ms=(pl.col("end_ns") - pl.col("start_ns")) / 1e6,
        n_ops="n_ops",
        exposed_wait_ms=pl.col("wait_ns") / 1e6,
        **{f"comm_{r}": pl.col(f"comm_{r}_ns") / 1e6 for r in roles},
    )
    per_step = (
        detail.group_by("step")
        .agg(pl.col("start_ns").min().alias("s0"), pl.col("end_ns").max().alias("e0"), pl.all().exclude("step"))
        .sort("step")
    )
    out = []
    for row in per_step.iter_rows(named=True):
        ranks = {}
        for i, rank in enumerate(row["rank"]):
            ranks[rank] = {
                "start_ns": row["start_ns"][i],
                "end_ns": row["end_ns"][i],
                "duration_ms": row["duration_ms"][i],
                "n_ops": row["n_ops"][i],
                "comm_ms": {r: row[f"comm_{r}"][i] for r in roles if row[f"comm_{r}"][i]},
                "exposed_wait_ms": row["exposed_wait_ms"][i],
            }
        start, end = int(row["s0"]), int(row["e0"])
        out.append(
            {
                "step": int(row["step"]),
                "start_ns": start,
                "end_ns": end,
                "duration_ms": (end - start) / 1e6,
                "ranks": ranks,
            }
        )
    return sorted(out, key=lambda s: s["step"])
