"""Partitioned vs whole-table analyses (hang, steps, perf; stragglers whole only) on a large synthetic store: time
and peak memory per task.

Writes a synthetic job into a store laid out as the site keeps it (``store/node-<n>/rank-<r>/s.parquet``):
``--ranks`` ranks, 8 per node, laid out TP 8 x PP 8 x DP (ranks / 64) (rank = dp * 64 + pp * 8 + tp). Each
rank repeats a 64-operation step: 48 all-reduces on its tensor-parallel group, 15 on its data-parallel group,
one on the world (sizes 1 KiB-64 MiB by place in the step, the same every step), ``--ops`` operations in all,
ending on a world all-reduce; rank 7 stops before its last one (a hang: every other rank waits in it). Each rank's
table is built with numpy and written straight to its Parquet object. Then, in the same run:

  - whole:       one process reads every file and runs the analysis (what a single job task did);
                 ``--no-whole`` leaves it out (a job too large for one process: the point of partitioning);
  - partitioned: one map task per partition the site would plan (hang and steps: whole ranks up to
                 ``--partition-rows`` rows; perf: whole communicators up to that many rows, read with a
                 ``comm_id`` filter from their members' files), then the reduce - for steps twice (stage 1's
                 maps and merge, then stage 2's); with 1 and 2 workers.

Stragglers (``--kinds stragglers``; the job has no step labels and no compute rows: steps are recovered, gaps are
the compute): their chord, as ``apps.analysis.partitions`` runs it (planning: two passes over batches of whole
ranks of up to ``--partition-rows`` rows, ``plan_in_batches``, then each window of whole steps written; one map
task per window; the reduce), each task in a fresh worker for
its own peak, then the whole-table task in a fresh worker; the reports must be equal, to the bit.

Tasks run in long-lived worker processes, as Celery's are (started and warmed up - libraries imported -
before the clock starts); a worker's peak RSS over the tasks it ran bounds each of its tasks' peaks, the
imported libraries included (~130 MiB). Checks that both ways give the same report (when the whole table
ran), then prints times, peak RSS, per-partition cost and the ratios.

Run: .venv/bin/python bench/partitioned_analysis.py [--ranks 256] [--ops 8192] [--partition-rows 500000]
     [--kinds hang,steps,perf,stragglers] [--no-whole] [--plan-only]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from comminsight.evidence import conform
from comminsight.evidence.schema import SCHEMA

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.analysis_partitioned.compare
PERF_COLUMNS = ["rank", "comm_id", "comm_size", "op", "is_p2p", "seq", "peer", "bytes", "start_ns", "end_ns"]
PERF_COLUMNS += ["enqueue_ns"]
STUCK_RANK = 7
READ_FILES = 256  # as apps.analysis.partitions reads a partition's files
TP = 8
WHOLE_ONLY = ("stragglers",)  # kinds measured as one whole-table task and as their chord's tasks, apart


STEP_OPS = 64  # a step: 48 TP all-reduces, 15 DP all-reduces, 1 world all-reduce
KIND_OF_POSITION = np.array([0] * 48 + [1] * 15 + [2])  # 0: TP, 1: DP, 2: world


def rank_table(rank: int, ranks: int, ops: int) -> pa.Table:
    """One rank's operations, one per ~100 us, built with numpy (no Python object per operation)."""
    rng = np.random.default_rng(rank)
    ops = max(STEP_OPS, ops - ops % STEP_OPS)  # whole steps: the last operation is a world all-reduce
    i = np.arange(ops)
    kind = KIND_OF_POSITION[i % STEP_OPS]
    seq = np.zeros(ops, np.int64)
    for k in range(3):  # the n-th operation on each communicator
        seq[kind == k] = np.arange(int((kind == k).sum()))
    tp_group, dp_group = rank // TP, rank % 64  # DP: the ranks of the same (pp, tp) place
    dp_size = max(ranks // 64, 1)
    size = np.array([TP, dp_size, ranks], np.int32)[kind]
    # 1 KiB .. 64 MiB by place in the step: every step repeats the same collectives with the same sizes, as
    # training does (sizes cycling with each communicator's count made the program repeat only every 17 steps).
    size_exp = 10 + (i % STEP_OPS) % 17
    nbytes = (1 << size_exp).astype(np.int64)
    start = 1_700_000_000_000_000_000 + i * 100_000 + rng.integers(0, 5_000, ops)
    end = start + 20_000 + nbytes // 50
    world = kind == 2
    last_world = world & (seq == seq[world].max())
    done = np.ones(ops, bool)
    if rank == STUCK_RANK:  # stops before its last world all-reduce; the world waits
        keep = ~last_world
        kind, seq, nbytes, start, end, size, done = (a[keep] for a in (kind, seq, nbytes, start, end, size, done))
    else:
        done &= ~last_world
        end = np.where(last_world, 0, end)
    n = len(seq)

    def text(values: list[str], index: np.ndarray | int) -> pa.Array:  # strings by index, no Python loop
        return pa.array(values).take(pa.array(np.broadcast_to(np.asarray(index, np.int64), (n,))))

    return conform(
        pa.table(
            {
                "workload": text(["bench"], 0),
                "node": text([f"node-{rank // 8}"], 0),
                "rank": np.full(n, rank, np.int32),
                "comm_id": text([f"tp-{tp_group}", f"dp-{dp_group}", "world"], kind),
                "comm_size": size,
                "op": text(["all_reduce"], 0),
                "is_p2p": np.zeros(n, bool),
                "seq": seq,
                "seq_kind": text(["comm"], 0),
                "count": nbytes // 2,
                "bytes": nbytes,
                "dtype": text(["bfloat16"], 0),
                "state": text(["started", "completed"], done.astype(np.int64)),
                "enqueue_ns": start - 1_000,
                "start_ns": start,
                "end_ns": pa.array(end, mask=end == 0),
                "source": text(["bench"], 0),
            }
        )
    )


def write_store(root: Path, ranks: int, ops: int) -> list[str]:
    files = []
    for rank in range(ranks):
        path = root / f"node-{rank // 8:05d}" / f"rank-{rank:06d}" / "s.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(rank_table(rank, ranks, ops), path, compression="zstd")
        files.append(str(path))
    return sorted(files)


# --- tasks (each in a fresh process) ---------------------------------------------------------------------------


def _warm() -> None:
    import comminsight.analysis.partitioned  # noqa: F401  (libraries imported before the clock starts)


def _settle(seconds: float) -> int:
    time.sleep(seconds)  # keeps one worker busy so the next warm-up lands on another
    return 0


def warm_pool(workers: int, fresh: bool = False) -> ProcessPoolExecutor:
    """Workers with the libraries imported; ``fresh``: a new process per task (each task's own peak, not the
    largest of the tasks its worker ran; its start-up is outside the task's time)."""
    # Spawned, not forked: the planner uses polars here, and a fork of a process with polars' threads can hang.
    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(workers, context, _warm, max_tasks_per_child=1 if fresh else None)
    if not fresh:
        list(pool.map(_settle, [0.5] * workers))
    return pool


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _timed(work: Callable[[], Any]) -> tuple[Any, float, float]:
    t0 = time.perf_counter()
    out = work()
    return out, time.perf_counter() - t0, _peak_mib()


def whole_task(kind: str, files: list[str]) -> tuple[str, float, float]:
    def work() -> str:
        from comminsight.analysis.hang import analyze_hang
        from comminsight.analysis.perf import analyse_perf

        table = ds.dataset(files, format="parquet", schema=SCHEMA).to_table()
        if kind == "steps":
            from comminsight.semantic import recover_steps

            return json.dumps(step_doc(recover_steps(table, compute_waits=True)), default=str)
        if kind == "stragglers":
            from comminsight.analysis.stragglers import analyse_stragglers

            return json.dumps(analyse_stragglers(table).to_dict(), default=str)
        report = analyze_hang(table) if kind == "hang" else analyse_perf(table)
        return json.dumps(report, default=str)

    return _timed(work)


def step_doc(report: Any, totals: Any = None) -> dict[str, Any]:
    """What the site stores of a large job's steps: per-step summaries from the (rank, step) totals."""
    from comminsight.analysis.partitioned import step_rows, step_totals

    totals = step_totals(report.rank_steps) if totals is None else totals
    return {"method": report.method, "methods": report.methods_by_rank, "steps": step_rows(totals)}


def map_task(
    kind: str, files: list[str], comm_ids: list[str] | None, seq_range: Any, out: str, stage: int = 1
) -> tuple[None, float, float]:
    def work() -> None:
        from comminsight.analysis.partitioned import hang_tail, perf_map, perf_slice_map, steps_evidence, steps_map

        dataset = ds.dataset(files, format="parquet", schema=SCHEMA)
        if kind == "steps" and stage == 1:
            evidence = steps_evidence(dataset.to_table())
            evidence.role_rows.write_parquet(f"{out}-roles.parquet")
            evidence.instances.write_parquet(f"{out}-instances.parquet")
            evidence.p2p.write_parquet(f"{out}-p2p.parquet")
            Path(f"{out}-shape.json").write_text(json.dumps({"shape_alone": evidence.shape_alone}))
            return
        if kind == "steps":  # stage 2, with stage 1's merge (written next to the partitions' summaries)
            run = Path(out).parent / Path(out).name.rsplit("-", 1)[0]
            table = pl.from_arrow(dataset.to_table())
            links = json.loads(Path(f"{run}-links-roles.json").read_text())
            shared = set(table.get_column("comm_id").unique().to_list()) & set(links["shared"])
            where = pc.field("comm_id").isin(pa.array(sorted(shared), pa.string()))
            instances = pl.from_arrow(ds.dataset(f"{run}-links-instances.parquet").to_table(filter=where))
            index = int(Path(out).name.rsplit("-", 1)[1])
            waits = pl.read_parquet(f"{run}-links-p2p.parquet").filter(pl.col("part") == index)
            part = steps_map(table, links["roles"], instances, waits, links["shared"], shape_alone=links["shape_alone"])
            part.rank_steps.write_parquet(f"{out}-steps.parquet")
            Path(f"{out}-methods.json").write_text(json.dumps({str(k): v for k, v in part.methods.items()}))
            return
        if kind == "hang":
            hang_tail(dataset.to_table()).write_parquet(f"{out}-tail.parquet")
            return
        where = pc.field("comm_id").isin(comm_ids)
        # As the site reads them: READ_FILES files per dataset (one keeps ~0.15 MiB per file it scanned).
        table = pa.concat_tables(
            ds.dataset(files[i : i + READ_FILES], format="parquet", schema=SCHEMA).to_table(
                columns=PERF_COLUMNS, filter=where
            )
            for i in range(0, len(files), READ_FILES)
        )
        if seq_range is None:
            summary = perf_map(table)
            names = ("groups", "samples")
        else:  # a slice of one communicator (the site's filter, on a polars frame of its rows)
            from comminsight.analysis.partitioned import slice_rows

            rows = pl.from_arrow(table)
            del table
            summary = perf_slice_map(rows.filter(slice_rows(*seq_range)))  # type: ignore[union-attr]
            names = ("values", "samples")
        if summary is not None:
            summary[0].write_parquet(f"{out}-{names[0]}.parquet")
            summary[1].write_parquet(f"{out}-{names[1]}.parquet")

    return _timed(work)


def reduce_task(kind: str, outs: list[str], stage: int = 1) -> tuple[str, float, float]:
    def work() -> str:
        from comminsight.analysis.partitioned import (
            StepsEvidence,
            StepsPart,
            hang_reduce,
            perf_reduce_by_rank,
            slice_groups,
            steps_links,
            steps_merge,
        )

        if kind == "steps" and stage == 1:
            run = outs[0].rsplit("-", 1)[0]

            def evidence(i: int) -> StepsEvidence:
                return StepsEvidence(
                    *(pl.read_parquet(f"{outs[i]}-{n}.parquet") for n in ("roles", "instances", "p2p")),
                    json.loads(Path(f"{outs[i]}-shape.json").read_text())["shape_alone"],
                )

            links = steps_links(len(outs), evidence)
            links.instances.write_parquet(f"{run}-links-instances.parquet", row_group_size=1 << 16)
            links.p2p_waits.write_parquet(f"{run}-links-p2p.parquet")
            doc = {"roles": links.roles, "shared": links.shared, "shape_alone": links.shape_alone}
            Path(f"{run}-links-roles.json").write_text(json.dumps(doc))
            return ""
        if kind == "steps":
            parts = (
                StepsPart(
                    pl.read_parquet(f"{o}-steps.parquet"),
                    {int(k): v for k, v in json.loads(Path(f"{o}-methods.json").read_text()).items()},
                    None,
                )
                for o in outs
            )
            return json.dumps(step_doc(*steps_merge(parts, per_rank=False)), default=str)
        if kind == "hang":
            report = hang_reduce(len(outs), lambda i: pl.read_parquet(f"{outs[i]}-tail.parquet"))
        elif kind == "hang-concat":  # the baseline: every tail held at once, as the merge did before it folded
            from comminsight.analysis import analyze_hang

            report = analyze_hang(pl.concat([pl.read_parquet(f"{o}-tail.parquet") for o in outs]))
        else:  # as the site merges: the samples a range of ranks at a time (64 ranks here)
            done = [o for o in outs if Path(f"{o}-groups.parquet").exists()]
            sliced = [o for o in outs if Path(f"{o}-values.parquet").exists()]
            merged = slice_groups(len(sliced), lambda i: pl.read_parquet(f"{sliced[i]}-values.parquet"))
            samples = pl.scan_parquet([f"{o}-samples.parquet" for o in done + sliced])
            high = samples.select(pl.col("rank").max()).collect().item()
            chunks = (
                samples.filter((pl.col("rank") >= lo) & (pl.col("rank") < lo + 64)).collect()
                for lo in range(0, high + 1, 64)
            )
            groups = [pl.read_parquet(f"{o}-groups.parquet") for o in done] + ([merged] if merged is not None else [])
            report = perf_reduce_by_rank(groups, chunks)
        return json.dumps(report, default=str)

    return _timed(work)


# --- planning (as apps.analysis.partitions does it) ------------------------------------------------------------


def plan(kind: str, files: list[str], max_rows: int) -> list[tuple[list[str], list[str] | None, Any]]:
    """(files, communicators or None, slice of sequence numbers or None) per partition."""
    from comminsight.analysis.partitioned import seq_bucket, seq_bucket_width, seq_slices

    if kind in ("hang", "steps"):
        parts: list[tuple[list[str], list[str] | None, Any]] = []
        current: list[str] = []
        rows = 0
        for location in files:  # one file per rank here
            n = pq.ParquetFile(location).metadata.num_rows
            if current and rows + n > max_rows:
                parts.append((current, None, None))
                current, rows = [], 0
            current.append(location)
            rows += n
        return [*parts, (current, None, None)] if current else parts
    counts: dict[str, int] = {}
    spans: dict[str, tuple[int, int]] = {}
    holders: dict[str, set[int]] = {}
    for index, location in enumerate(files):  # which files hold each communicator's rows, and its sequence span
        found = pl.read_parquet(location, columns=["comm_id", "seq"])
        per_comm = found.group_by("comm_id").agg(pl.len(), low=pl.col("seq").min(), high=pl.col("seq").max())
        for comm, count, low, high in per_comm.iter_rows():
            counts[comm] = counts.get(comm, 0) + count
            holders.setdefault(comm, set()).add(index)
            if low is not None:
                known = spans.get(comm, (low, high))
                spans[comm] = (min(known[0], low), max(known[1], high))
    large = {c for c, n in counts.items() if n > max_rows}
    widths = {c: seq_bucket_width(*spans.get(c, (0, 0))) for c in large}
    buckets: dict[str, dict[int, int]] = {c: {} for c in large}
    for location in sorted({files[i] for c in large for i in holders[c]}):  # rows per range of sequence numbers
        found = pl.read_parquet(location, columns=["comm_id", "seq", "is_p2p"]).filter(pl.col("comm_id").is_in(large))
        for (comm,), part in found.partition_by("comm_id", as_dict=True).items():
            ranges = part.select(b=seq_bucket(spans.get(comm, (0, 0))[0], widths[comm])).get_column("b")
            for bucket, count in ranges.value_counts().iter_rows():
                buckets[comm][bucket] = buckets[comm].get(bucket, 0) + count
    out: list[tuple[list[str], list[str] | None, Any]] = []
    groups: list[list[str]] = []
    current_comms: list[str] = []
    rows = 0
    for comm in sorted(counts):
        if comm in large:  # slices, each a partition of its own
            members = [files[i] for i in sorted(holders[comm])]
            low = spans.get(comm, (0, 0))[0]
            out += [(members, [comm], piece) for piece in seq_slices(buckets[comm], low, widths[comm], max_rows)]
            continue
        if current_comms and rows + counts[comm] > max_rows:
            groups.append(current_comms)
            current_comms, rows = [], 0
        current_comms.append(comm)
        rows += counts[comm]
    groups += [current_comms] if current_comms else []
    whole = [([files[i] for i in sorted(set().union(*(holders[c] for c in g)))], g, None) for g in groups]
    return whole + out


def _label(part: tuple[list[str], list[str] | None, Any]) -> str:
    files, comm_ids, seq_range = part
    if comm_ids is None:
        return f"{len(files)} ranks"
    if seq_range is not None:
        return f"{comm_ids[0]} seq [{seq_range[0]}, {seq_range[1]}) ({len(files)} files)"
    return f"{len(comm_ids)} communicators ({len(files)} files)"


def run_partitioned(
    kind: str, files: list[str], max_rows: int, workers: int, scratch: Path, fresh: bool = False
) -> dict[str, Any]:
    stages = 2 if kind == "steps" else 1
    maps: list[tuple[None, float, float]] = []
    reduces: list[tuple[str, float, float]] = []
    labels: list[str] = []
    with warm_pool(workers, fresh) as pool:
        t0 = time.perf_counter()
        parts = plan(kind, files, max_rows)
        t_plan = time.perf_counter() - t0
        outs = [str(scratch / f"{kind}-{workers}-{i:05d}") for i in range(len(parts))]
        t_reduce = 0.0
        for stage in range(1, stages + 1):
            n = len(parts)
            columns = [[p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts]]
            maps += pool.map(map_task, [kind] * n, *columns, outs, [stage] * n)
            labels += [f"stage {stage}: {_label(p)}" if stages > 1 else _label(p) for p in parts]
            # the reduce in a worker of its own, so its peak is not the maps'
            with warm_pool(1) as reducer:
                t1 = time.perf_counter()
                reduces.append(reducer.submit(reduce_task, kind, outs, stage).result())
                t_reduce += time.perf_counter() - t1
        wall = time.perf_counter() - t0
        baseline = None
        if kind == "hang":  # the same tails merged without folding, in a worker of its own (not timed in wall)
            with warm_pool(1) as reducer:
                baseline = reducer.submit(reduce_task, "hang-concat", outs).result()
            from tests.analysis_partitioned.compare import settled

            assert settled(json.loads(baseline[0])) == settled(json.loads(reduces[-1][0])), "hang: folded merge differs"
        tail_rows = sum(pq.ParquetFile(f"{o}-tail.parquet").metadata.num_rows for o in outs) if kind == "hang" else 0
    return {
        "report": reduces[-1][0],
        "wall_s": wall,
        "plan_s": t_plan,
        "partitions": len(parts),
        "maps": len(maps),
        "map_s_max": max(m[1] for m in maps),
        "map_s_sum": sum(m[1] for m in maps),
        "map_peak_mib_max": max(m[2] for m in maps),
        "reduce_s": t_reduce,
        "reduce_peak_mib": max(r[2] for r in reduces),
        "baseline_reduce_s": baseline[1] if baseline else None,
        "baseline_reduce_peak_mib": baseline[2] if baseline else None,
        "tail_rows": tail_rows,
        "reduces": [(r[1], r[2]) for r in reduces],
        "largest_maps": sorted(((m[2], m[1], label) for m, label in zip(maps, labels, strict=True)), reverse=True)[:3],
    }


TASK_LIMIT_MIB = 2048  # the bound on any one task's peak memory


def whole_only_task(kind: str, files: list[str]) -> tuple[str, float, float, float]:
    """A kind that is not partitioned, in a fresh worker: (report, seconds, peak RSS before the task, peak RSS)."""
    before = _peak_mib()
    report, took, peak = whole_task(kind, files)
    return report, took, before, peak


def _store_doc(prefix: str, doc: dict[str, Any], frames: dict[str, Any]) -> None:
    for name, frame in frames.items():
        frame.write_parquet(f"{prefix}-{name}.parquet")
    Path(f"{prefix}.json").write_text(json.dumps({**doc, "_frames": sorted(frames)}))


def _load_doc(prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
    doc = json.loads(Path(f"{prefix}.json").read_text())
    return doc, {name: pl.read_parquet(f"{prefix}-{name}.parquet") for name in doc.pop("_frames")}


def _stragglers_plan(files: list[str], max_rows: int, out: str) -> int:
    """The stragglers chord's planning (as ``apps.analysis.partitions`` runs it): two passes over batches of whole
    ranks (``plan_in_batches``), then each window's rows written; the number of windows."""
    from comminsight.analysis.straggler_plan import (
        PLAN_BATCH_ROWS,
        PLAN_COLUMNS,
        LocalScratch,
        plan_in_batches,
        write_window,
    )

    # Whole ranks, as the site batches them.
    batches = [part[0] for part in plan("hang", files, min(max_rows, PLAN_BATCH_ROWS))]
    columns = [c for c in PLAN_COLUMNS if c in SCHEMA.names]  # only what planning reads

    def load(i: int) -> pl.DataFrame:
        frame = pl.from_arrow(ds.dataset(batches[i], format="parquet", schema=SCHEMA).to_table(columns=columns))
        assert isinstance(frame, pl.DataFrame)
        return frame

    scratch = LocalScratch(f"{out}-scratch")
    planned = plan_in_batches(len(batches), load, scratch, max_rows=max_rows)
    for i in range(len(planned.plan.windows)):
        write_window(scratch, planned, i, f"{out}-window-{i:06d}.parquet")
    _store_doc(f"{out}-plan", *planned.plan.to_stored())
    _store_doc(f"{out}-facts", *planned.facts.to_stored())
    return len(planned.plan.windows)


def _stragglers_whole_plan(files: list[str], max_rows: int, out: str) -> list:
    """The planning over the whole table (``prepare_table``, ``plan_preparation``), as the chord planned before
    ``plan_in_batches``, for ``--plan-only``'s comparison; the windows."""
    from comminsight.analysis import stragglers as st

    df, facts = st.prepare_table(ds.dataset(files, format="parquet", schema=SCHEMA).to_table())
    plan = st.plan_preparation(df, prepare=facts.evidence is None, max_rows=max_rows)
    for i in range(len(plan.windows)):
        st.window_rows(df, plan, i).write_parquet(f"{out}-whole-window-{i:06d}.parquet")
    return plan.windows


def _stragglers_map(out: str, index: int) -> None:
    """One window prepared and its part written (a map task of the stragglers chord)."""
    from comminsight.analysis import stragglers as st

    plan = st.PreparationPlan.from_stored(*_load_doc(f"{out}-plan"))
    part = st.prepare_window(pl.read_parquet(f"{out}-window-{index:06d}.parquet"), plan, index)
    for name, frame in part.to_frames().items():
        frame.write_parquet(f"{out}-part-{index:06d}-{name}.parquet")


def _stragglers_reduce(out: str, windows: int) -> str:
    """The windows' parts merged into the report (the stragglers chord's reduce), as JSON."""
    from comminsight.analysis import stragglers as st

    plan = st.PreparationPlan.from_stored(*_load_doc(f"{out}-plan"))
    facts = st.JobFacts.from_stored(*_load_doc(f"{out}-facts"))
    names = ("per", "late", "edges", "columns", "vocab", "meta")
    parts = (
        st.WindowPart.from_frames({n: pl.read_parquet(f"{out}-part-{i:06d}-{n}.parquet") for n in names})
        for i in range(windows)
    )
    return json.dumps(st.report_from_windows(facts, plan, parts).to_dict(), default=str)


STRAGGLERS_PHASES: dict[str, Callable[..., Any]] = {
    "plan": _stragglers_plan,
    "whole-plan": _stragglers_whole_plan,
    "map": _stragglers_map,
    "reduce": _stragglers_reduce,
}


def stragglers_task(phase: str, *args: Any) -> tuple[Any, float, float, float]:
    """One task of the stragglers chord (``phase``, a key of ``STRAGGLERS_PHASES``, with its arguments), measured
    in its worker: (its result, seconds, peak RSS before the task, peak RSS)."""
    before = _peak_mib()
    result, took, peak = _timed(lambda: STRAGGLERS_PHASES[phase](*args))
    return result, took, before, peak


def run_stragglers_chord(files: list[str], max_rows: int, scratch: Path) -> dict[str, Any]:
    """The stragglers chord, each task in a fresh warmed worker (its own peak): planning, the maps, the reduce."""
    out = str(scratch / "stragglers")
    t0 = time.perf_counter()
    with warm_pool(1, fresh=True) as pool:
        windows, plan_s, plan_before, plan_peak = pool.submit(stragglers_task, "plan", files, max_rows, out).result()
    with warm_pool(1, fresh=True) as pool:
        maps = list(pool.map(stragglers_task, ["map"] * windows, [out] * windows, range(windows)))
    with warm_pool(1, fresh=True) as pool:
        report, reduce_s, reduce_before, reduce_peak = pool.submit(stragglers_task, "reduce", out, windows).result()
    return {
        "report": report,
        "wall_s": time.perf_counter() - t0,
        "windows": windows,
        "plan": (plan_s, plan_peak - plan_before),
        "map_max": max((m[3] - m[2], m[1]) for m in maps),
        "map_s_sum": sum(m[1] for m in maps),
        "reduce": (reduce_s, reduce_peak - reduce_before),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--ops", type=int, default=8192, help="operations per rank")
    parser.add_argument("--partition-rows", type=int, default=500_000)
    parser.add_argument("--kinds", default="hang,steps,perf")
    parser.add_argument("--no-whole", action="store_true", help="leave out the whole-table run (too large)")
    parser.add_argument(
        "--plan-only",
        action="store_true",
        help="stragglers: only the chord's planning, in batches and over the whole table (their peaks, same windows)",
    )
    parser.add_argument("--workers", default="1,2")
    parser.add_argument(
        "--fresh-maps", default="", help="kinds whose map tasks each run in a new process (per-task peaks)"
    )
    args = parser.parse_args()
    from tests.analysis_partitioned.compare import canonical, settled

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        files = write_store(root / "store", args.ranks, args.ops)
        rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
        store_mib = sum(Path(f).stat().st_size for f in files) / 2**20
        took = time.perf_counter() - t0
        print(f"store: {args.ranks} ranks, {rows:,} operations, {store_mib:.0f} MiB Parquet (written in {took:.0f} s)")
        for kind in args.kinds.split(","):
            whole_report, whole_s, whole_peak = None, float("nan"), float("nan")
            if kind in WHOLE_ONLY and args.plan_only:
                out = str(root / "stragglers")
                with warm_pool(1, fresh=True) as pool:
                    n, took, before, peak = pool.submit(
                        stragglers_task, "plan", files, args.partition_rows, out
                    ).result()
                if args.no_whole:
                    print(
                        f"\n{kind} planning in batches of whole ranks, in a fresh worker: {took:.1f} s"
                        f" +{peak - before:.0f} MiB over its warmed start; {n} windows of <= {args.partition_rows:,}"
                        " rows (the whole-table planning left out with --no-whole)",
                        flush=True,
                    )
                    continue
                with warm_pool(1, fresh=True) as pool:
                    windows, whole_s, whole_before, whole_peak = pool.submit(
                        stragglers_task, "whole-plan", files, args.partition_rows, out
                    ).result()
                print(
                    f"\n{kind} planning, each in a fresh worker (growth over its warmed start): in batches of whole"
                    f" ranks {took:.1f} s +{peak - before:.0f} MiB; over the whole table {whole_s:.1f} s"
                    f" +{whole_peak - whole_before:.0f} MiB; {n} windows of <= {args.partition_rows:,} rows",
                    flush=True,
                )
                planned = json.loads(Path(f"{out}-plan.json").read_text())["windows"]
                assert planned == [list(w) for w in windows], f"{kind}: the windows differ"
                same = all(
                    pl.read_parquet(f"{out}-window-{i:06d}.parquet").equals(
                        pl.read_parquet(f"{out}-whole-window-{i:06d}.parquet")
                    )
                    for i in range(n)
                )
                assert same, f"{kind}: a window's rows differ"
                print(f"{kind}: both plannings cut the same windows of the same rows")
                continue
            if kind in WHOLE_ONLY:
                chord = run_stragglers_chord(files, args.partition_rows, root)
                plan_s, plan_mib = chord["plan"]
                map_mib, map_s = chord["map_max"]
                reduce_s, reduce_mib = chord["reduce"]
                print(
                    f"\n{kind} chord, each task in a fresh worker (growth over its warmed start):"
                    f" {chord['windows']} windows of <= {args.partition_rows:,} rows, {chord['wall_s']:.1f} s in all;"
                    f" planning {plan_s:.1f} s +{plan_mib:.0f} MiB; largest map task +{map_mib:.0f} MiB"
                    f" ({map_s:.1f} s; maps {chord['map_s_sum']:.1f} s in all); reduce {reduce_s:.1f} s"
                    f" +{reduce_mib:.0f} MiB",
                    flush=True,
                )
                if args.no_whole:
                    print(f"{kind}: the whole-table task left out with --no-whole")
                    continue
                with warm_pool(1, fresh=True) as pool:
                    report, took, before, peak = pool.submit(whole_only_task, kind, files).result()
                summary = json.loads(report)
                print(
                    f"{kind}: the whole-table task, in a fresh worker: {took:.1f} s, peak {peak:.0f} MiB"
                    f" (+{peak - before:.0f} MiB over the warmed worker's {before:.0f}:"
                    f" {(peak - before) * 2**20 / rows:.0f} bytes per operation, the table read included);"
                    f" {summary['slowdown']['steps']} steps, culprits {summary['culprits'][:8]},"
                    f" ratio x{summary['slowdown']['ratio']:.3f}",
                    flush=True,
                )
                assert json.loads(chord["report"]) == summary, f"{kind}: the chord's report differs"
                print(f"{kind}: the chord's report equals the whole-table task's")
                continue
            if not args.no_whole:
                with warm_pool(1) as pool:
                    t1 = time.perf_counter()
                    whole_report, _, whole_peak = pool.submit(whole_task, kind, files).result()
                    whole_s = time.perf_counter() - t1
            same = settled if kind == "hang" else canonical
            runs = {}
            for w in (int(x) for x in args.workers.split(",")):
                fresh = kind in args.fresh_maps.split(",")
                runs[w] = run_partitioned(kind, files, args.partition_rows, w, root, fresh)
                if whole_report is not None:
                    assert same(json.loads(runs[w]["report"])) == same(json.loads(whole_report)), f"{kind}: differ"
            first = runs[min(runs)]
            limit = f"{args.partition_rows:,}"
            print(
                f"\n{kind}: {first['partitions']} partitions of <= {limit} rows, {first['maps']} map tasks"
                f" (plan {first['plan_s']:.1f} s)",
                flush=True,
            )
            if whole_report is not None:
                print(f"  whole table, one task:   {whole_s:7.1f} s   peak {whole_peak:7.0f} MiB")
            for w, run in sorted(runs.items()):
                print(
                    f"  partitioned, {w} worker{'s' if w > 1 else ' '}:  {run['wall_s']:7.1f} s"
                    f"   map tasks {run['map_s_sum']:.1f} s in all ({run['map_s_sum'] / run['maps']:.2f} s each,"
                    f" slowest {run['map_s_max']:.1f} s), peak of a map worker {run['map_peak_mib_max']:.0f} MiB;"
                    f" reduce {run['reduce_s']:.1f} s / {run['reduce_peak_mib']:.0f} MiB"
                )
            if kind == "hang":
                print(
                    f"  merge: folded {first['reduce_s']:.1f} s / {first['reduce_peak_mib']:.0f} MiB against every tail"
                    f" at once {first['baseline_reduce_s']:.1f} s / {first['baseline_reduce_peak_mib']:.0f} MiB"
                    f" (ratio of peaks {first['baseline_reduce_peak_mib'] / first['reduce_peak_mib']:.2f},"
                    f" same report; {first['tail_rows']:,} tail rows, {first['tail_rows'] / args.ranks:.0f} a rank)"
                )
            else:
                merges = "; ".join(f"{t:.1f} s / {m:.0f} MiB" for t, m in first["reduces"])
                print(f"  merge{'s by stage' if len(first['reduces']) > 1 else ''}: {merges}")
            peaks = "; ".join(f"{label}: {t:.1f} s, {m:.0f} MiB" for m, t, label in first["largest_maps"])
            each = "per task" if kind in args.fresh_maps.split(",") else "worker peak after the task"
            print(f"  largest map tasks ({each}): {peaks}")
            if kind == "steps":
                found = json.loads(first["report"])
                print(f"  steps found: {len(found['steps'])} (method {found['method']})")
            peak = max(max(r["map_peak_mib_max"], r["reduce_peak_mib"]) for r in runs.values())
            verdict = "within" if peak <= TASK_LIMIT_MIB else "OVER"
            print(f"  largest task's peak {peak:.0f} MiB: {verdict} {TASK_LIMIT_MIB} MiB")
            if len(runs) > 1:
                print(f"  ratio: {max(runs)} workers / 1 worker {runs[max(runs)]['wall_s'] / runs[1]['wall_s']:.2f}")
            if whole_report is not None:
                print(
                    f"  ratios: time 1 worker / whole {first['wall_s'] / whole_s:.2f};"
                    f" largest task's peak / whole {peak / whole_peak:.2f}; reports identical (after ordering ties)"
                )
            sys.stdout.flush()


if __name__ == "__main__":
    main()
