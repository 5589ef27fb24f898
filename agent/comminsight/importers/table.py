"""Per-operation tables (CSV or Parquet) into the operations table.

Many tools and papers publish one row per operation per rank: a rank, an operation name, a
start time and a duration, sometimes a step, a sequence number and parallel coordinates. This
importer finds those columns by name (the mapping is documented in docs/semantic.md, "Per-
operation tables"), converts times to nanoseconds, and fills what the table does not say:

* **Time units** come from the column name's suffix (``_ns``, ``_us``, ``_ms``, ``_s``); an
  unsuffixed floating-point column is seconds, an unsuffixed integer column nanoseconds.
* **Per-step relative clocks**: when the table has a step column and each step's times restart
  (a later step begins within the first quarter of the previous one: at the same relative zero),
  the steps are laid end to end, in step order, into one timeline: each step is shifted so it
  begins where the previous one ended. Steps that merely overlap (a pipeline's first stage starts
  the next step while its last stage finishes this one) are one timeline already.
* **Communicators**, when no communicator column exists, are inferred from timing: the members
  of a collective finish together (their end times agree far better than their start times).
  For every operation name the importer tries the candidate member groups (all ranks, then
  the groups that share all parallel coordinates but one) and keeps the largest whose end
  times agree; an operation that synchronises with no one is local. A non-communication name
  that does synchronise becomes op ``other`` on that group. Point-to-point rows share one
  communicator per pipeline group.
* **Sequence numbers** that are missing or restart (e.g. per step) are replaced by each rank's
  running count per communicator, which is what NCCL counts.

Nothing is written; bad input raises ``EvidenceError`` naming the file and the problem.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa

from comminsight.evidence.schema import OPS, conform
from comminsight.importers import EvidenceError, Importer, register
from comminsight.importers.columns import MAX_ROWS

# This importer loads the whole table: a CSV file or a Parquet table's uncompressed data (which a
# few compressed kilobytes can describe in gigabytes) is held to a size that keeps memory under 1 GB.
MAX_BYTES = 256 << 20
MAX_LABEL_CHARS = 256
# A CSV table's shape: its values become 8-byte cells (or longer strings), so their number bounds memory.
MAX_COLUMNS = 256
MAX_CELLS = 32_000_000
MAX_HEADER_BYTES = 64 << 10

# Canonical column -> accepted source names (lower case), in preference order.
COLUMN_ALIASES: dict[str, tuple[str, ...]] = {
    "rank": ("rank", "global_rank", "rank_id", "worker_rank"),
    "op": ("op", "optype", "op_type", "operation", "op_name", "collective", "name"),
    "start": ("start_ns", "start_us", "start_ms", "start_s", "start_ts", "start_time", "start", "begin", "ts"),
    "end": ("end_ns", "end_us", "end_ms", "end_s", "end_ts", "end_time", "end", "finish"),
    "duration": ("duration_ns", "duration_us", "duration_ms", "duration_s", "duration", "dur", "elapsed"),
    "enqueue": ("enqueue_ns", "enqueue_us", "enqueue_ms", "enqueue_s", "enqueue_ts", "enqueue"),
    "step": ("step", "step_id", "iteration", "iter"),
    "seq": ("seq", "seq_id", "seqnum", "collective_seq_id"),
    "comm_id": ("comm_id", "communicator", "comm", "pg_id", "process_group", "pg"),
    "comm_name": ("comm_name", "pg_name"),
    "comm_desc": ("comm_desc", "pg_desc", "group_desc"),
    "comm_size": ("comm_size", "group_size", "nranks"),
    "bytes": ("bytes", "nbytes", "size_bytes", "msg_bytes", "msg_size"),
    "count": ("count", "nelems", "numel"),
    "dtype": ("dtype", "data_type"),
    "peer": ("peer", "peer_rank"),
    "dp_rank": ("dp_rank", "dp", "data_parallel_rank"),
    "pp_rank": ("pp_rank", "pp", "stage", "pp_stage", "pipeline_stage"),
    "tp_rank": ("tp_rank", "tp", "tensor_parallel_rank"),
    "cp_rank": ("cp_rank", "cp", "context_parallel_rank", "dsp_rank"),
    "node": ("node", "node_ip"),
    "host": ("host", "hostname"),
}
_REQUIRED = ("rank", "op", "start")
_UNIT_NS = {"ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9}
_COORDS = ("dp_rank", "pp_rank", "tp_rank", "cp_rank")
# End-time agreement that makes a group synchronising: ends spread at most this share of starts.
SYNC_RATIO = 0.2
SYNC_FLOOR_NS = 20_000  # end spreads below this are clock noise, not a different group


def _columns_of(path: Path) -> list[str]:
    """Column names from the file's header only (Parquet footer, CSV first line)."""
    if path.suffix.lower() in (".parquet", ".pq"):
        import pyarrow.parquet as pq

        return list(pq.read_schema(path).names)
    with path.open("rb") as fh:
        head = fh.readline(64 * 1024).decode("utf-8", errors="replace")
    return [c.strip().strip('"').strip() for c in head.split(",")]


def map_columns(names: list[str]) -> dict[str, str]:
    """Canonical column -> source column for ``names``, by COLUMN_ALIASES (case-insensitive)."""
    lower = {n.lower(): n for n in names}
    mapping: dict[str, str] = {}
    for canonical, aliases in COLUMN_ALIASES.items():
        for alias in aliases:
            if alias in lower and lower[alias] not in mapping.values():
                mapping[canonical] = lower[alias]
                break
    return mapping


def detect(path: Path) -> bool:
    """A CSV/Parquet file whose header names a rank, an operation and a start time."""
    if not path.is_file() or path.suffix.lower() not in (".csv", ".parquet", ".pq"):
        return False
    try:
        mapping = map_columns(_columns_of(path))
    except Exception:
        return False
    return all(c in mapping for c in _REQUIRED)


def normalise_op(label: str) -> str:
    """The schema op for a source operation name (``forward-send`` -> send, ``grads-reduce-scatter`` -> ...)."""
    s = re.sub(r"[^a-z0-9]", "", label.lower())
    for key, op in (
        ("allreduce", "all_reduce"),
        ("allgather", "all_gather"),
        ("reducescatter", "reduce_scatter"),
        ("alltoall", "all_to_all"),
        ("broadcast", "broadcast"),
        ("bcast", "broadcast"),
        ("barrier", "barrier"),
        ("send", "send"),
        ("recv", "recv"),
        ("receive", "recv"),
        ("reduce", "reduce"),
        ("gather", "gather"),
        ("scatter", "scatter"),
        ("coalesced", "coalesced"),
    ):
        if key in s:
            return op
    if any(k in s for k in ("compute", "forward", "backward", "optimizer", "fwd", "bwd", "kernel", "gc", "gemm")):
        return "compute"
    return "other"


def _unit_of(column: str, dtype: pl.DataType) -> float:
    suffix = column.lower().rsplit("_", 1)[-1] if "_" in column else ""
    if suffix in _UNIT_NS:
        return _UNIT_NS[suffix]
    return 1e9 if dtype.is_float() else 1.0


def check_parquet_size(path: Path) -> None:
    """Refuse a Parquet file whose data, uncompressed, is over MAX_BYTES (read from its footer only)."""
    import pyarrow.parquet as pq

    try:
        metadata = pq.ParquetFile(path).metadata
    except (OSError, pa.ArrowException) as exc:
        raise EvidenceError(f"{path}: cannot read as a table: {exc}") from exc
    size = sum(max(metadata.row_group(i).total_byte_size, 0) for i in range(metadata.num_row_groups))
    if size > MAX_BYTES:
        raise EvidenceError(f"{path}: {size} bytes uncompressed is over the {MAX_BYTES}-byte limit for tables")
    if metadata.num_rows > MAX_ROWS:  # run-length and dictionary encodings make rows nearly free on disk
        raise EvidenceError(f"{path}: {metadata.num_rows} rows is over the limit of {MAX_ROWS} for tables")


def _read(path: Path) -> pl.DataFrame:
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise EvidenceError(f"{path}: {size} bytes is over the {MAX_BYTES}-byte limit for per-operation tables")
    try:
        if path.suffix.lower() in (".parquet", ".pq"):
            check_parquet_size(path)
            return _bounded_strings(path, pl.read_parquet(path, columns=_parquet_columns(path)))
        # Parsing stops one row past what may be read: a file of tiny rows (or many columns) holds far
        # more cells than its size suggests.
        limit = _csv_row_limit(path)
        frame = pl.read_csv(path, infer_schema_length=10000, n_rows=limit + 1)
    except EvidenceError:
        raise
    except Exception as exc:
        raise EvidenceError(f"{path}: cannot read as a table: {exc}") from exc
    if frame.height > limit:
        raise EvidenceError(f"{path}: more than {limit} rows of {frame.width} columns, over the limit for tables")
    return frame


def _parquet_columns(path: Path) -> list[str]:
    """The columns the table is made of, each a plain value: the rest is never decoded, and a nested
    column (lists, structs) is refused, since its encoded size says nothing of its decoded size."""
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    wanted = set(map_columns(schema.names).values())
    for field in schema:
        if field.name in wanted and pa.types.is_nested(field.type):
            raise EvidenceError(f"{path}: column {field.name!r} holds {field.type}, not plain values")
    return [name for name in schema.names if name in wanted]


def _bounded_strings(path: Path, frame: pl.DataFrame) -> pl.DataFrame:
    """Refuse text columns that decode to more than MAX_BYTES: Parquet's dictionary encoding stores a
    long string once for any number of rows, so the footer's sizes cannot bound them."""
    total = 0
    for name, dtype in frame.schema.items():
        column = frame.get_column(name)
        if dtype == pl.String:  # views onto shared buffers: measured without copying
            total += int(column.str.len_bytes().sum() or 0)
        elif isinstance(dtype, pl.Categorical | pl.Enum):  # a dictionary column: each value times its count
            counts = column.value_counts(name="n").with_columns(pl.col(name).cast(pl.String).str.len_bytes())
            total += int((counts.get_column(name).cast(pl.Int64) * counts.get_column("n")).sum() or 0)
        if total > MAX_BYTES:
            raise EvidenceError(f"{path}: its text decodes to over {MAX_BYTES} bytes, over the limit for tables")
    return frame


def _csv_row_limit(path: Path) -> int:
    """Rows a CSV table may have: MAX_ROWS, fewer when it is wide (at most MAX_CELLS values in all)."""
    with path.open("rb") as f:
        header = f.readline(MAX_HEADER_BYTES + 1)
    if len(header) > MAX_HEADER_BYTES:
        raise EvidenceError(f"{path}: a header line longer than {MAX_HEADER_BYTES} bytes")
    columns = header.count(b",") + 1
    if columns > MAX_COLUMNS:
        raise EvidenceError(f"{path}: {columns} columns is over the limit of {MAX_COLUMNS} for tables")
    return min(MAX_ROWS, MAX_CELLS // columns)


def _times_ns(df: pl.DataFrame, column: str, path: Path) -> np.ndarray:
    series = df.get_column(column)
    if not series.dtype.is_numeric():
        try:
            series = series.cast(pl.Float64, strict=True)
        except Exception as exc:
            raise EvidenceError(f"{path}: time column {column!r} is not numeric") from exc
    unit = _unit_of(column, series.dtype)
    values = series.cast(pl.Float64).to_numpy()
    if np.isnan(values).any() or np.isinf(values).any():
        raise EvidenceError(f"{path}: time column {column!r} has missing or infinite values")
    scaled = values * unit
    if np.abs(scaled).max(initial=0.0) > 9.0e18:
        raise EvidenceError(f"{path}: time column {column!r} is out of range")
    return np.rint(scaled).astype(np.int64)


def lay_steps_end_to_end(step: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Shift each step's times so steps follow one another when their clocks restart per step.

    Returns new (start, end). Leaves the times alone when steps already follow in time.
    """
    steps, inverse = np.unique(step, return_inverse=True)
    if len(steps) < 2:
        return start, end
    lo = np.full(len(steps), np.iinfo(np.int64).max)
    hi = np.full(len(steps), np.iinfo(np.int64).min)
    np.minimum.at(lo, inverse, start)
    np.maximum.at(hi, inverse, end)
    span = hi - lo
    # One timeline: each step begins well after the previous one began. Steps of a pipeline
    # overlap (the first stage starts step k+1 while the last still finishes step k), so
    # "begins before the previous one ends" is no sign of a restarting clock; a step that begins
    # within the first quarter of the previous one's span (at the same relative zero) is.
    if np.all(lo[1:] >= lo[:-1] + 0.25 * span[:-1]):
        return start, end
    begin = np.concatenate(([lo[0]], lo[0] + np.cumsum(span[:-1])))
    shift = (begin - lo)[inverse]
    return start + shift, end + shift


def _ordinal(frame: pl.DataFrame, keys: list[str]) -> pl.Series:
    """Running count (0, 1, ...) of rows within ``keys`` in start-time order."""
    return frame.select(pl.col("start_ns").rank("ordinal").over(keys).cast(pl.Int64) - 1).to_series()


def _infer_communicators(frame: pl.DataFrame, coords: list[str]) -> pl.DataFrame:
    """Add comm_id/comm_size/comm_ranks/op for a table without communicator columns (see module doc)."""
    frame = frame.with_columns(_occ=_ordinal(frame, ["rank", "label"]))
    # Candidate member groups: everyone, then "same coordinates except one" (largest groups first).
    candidates: list[tuple[str, list[str]]] = [("all", [])]
    sized = []
    for varying in coords:
        held = [c for c in coords if c != varying]
        groups = frame.select(held).n_unique() if held else 1
        sized.append((frame.get_column(varying).n_unique() / max(groups, 1), varying, held))
    for _, varying, held in sorted(sized, key=lambda t: -t[0]):
        candidates.append((varying, held))
    collective = frame.filter(~pl.col("op").is_in(["send", "recv"]))
    # Per label and candidate: median end spread (es) and start spread (ss) over instances.
    stats: dict[str, list[tuple[str, list[str], float]]] = {}
    for name, held in candidates:
        keys = ["label", "_occ", *held]
        spread = (
            collective.group_by(keys)
            .agg(
                n=pl.col("rank").n_unique(),
                es=pl.col("end_ns").max() - pl.col("end_ns").min(),
                ss=pl.col("start_ns").max() - pl.col("start_ns").min(),
            )
            .filter(pl.col("n") > 1)
            .group_by("label")
            .agg(pl.col("es").median(), pl.col("ss").median())
        )
        for label, es, ss in spread.iter_rows():
            if ss > 0 and es <= SYNC_RATIO * ss:
                stats.setdefault(label, []).append((name, held, float(es)))
    # The largest group whose ends agree about as well as the tightest synchronising group's.
    chosen: dict[str, tuple[str, list[str]]] = {}
    for label, options in stats.items():
        tightest = min(es for _, _, es in options)
        for name, held, es in options:  # candidates are in largest-group-first order
            if es <= max(2.0 * tightest, SYNC_FLOOR_NS):
                chosen[label] = (name, held)
                break
    labels = frame.get_column("label").unique().to_list()
    group_of = pl.DataFrame(
        {
            "label": labels,
            "_group": [chosen.get(lbl, ("local", []))[0] for lbl in labels],
        },
        schema={"label": frame.schema["label"], "_group": pl.String},
    )
    frame = frame.join(group_of, on="label", how="left")
    p2p = pl.col("op").is_in(["send", "recv"])
    pipeline_held = [c for c in coords if c != "pp_rank"] if "pp_rank" in coords else []
    parts = []
    for name, held in [("local", ["rank"]), *candidates]:
        sub = frame.filter((pl.col("_group") == name) & ~p2p)
        if sub.height:
            parts.append(_with_group(sub, held, sync=name != "local"))
    sub = frame.filter(p2p)
    if sub.height:
        parts.append(_with_group(sub, pipeline_held, sync=True, prefix="p2p"))
    return pl.concat(parts, how="diagonal_relaxed").drop("_group", "_occ")


def _with_group(sub: pl.DataFrame, held: list[str], sync: bool, prefix: str | None = None) -> pl.DataFrame:
    key = pl.concat_str([pl.lit(c + "=") + pl.col(c).cast(pl.String) for c in held], separator=",") if held else None
    label_part = pl.lit(prefix) if prefix else pl.col("label")
    comm_id = label_part if key is None else pl.concat_str([label_part, pl.lit("@"), key])
    sub = sub.with_columns(comm_id=comm_id)
    members = sub.group_by("comm_id").agg(comm_ranks=pl.col("rank").unique().sort())
    index = members.explode("comm_ranks").with_columns(comm_rank=pl.int_range(pl.len(), dtype=pl.Int32).over("comm_id"))
    index = index.rename({"comm_ranks": "rank"}).with_columns(pl.col("rank").cast(sub.schema["rank"]))
    sub = sub.join(members, on="comm_id", how="left").join(index, on=["comm_id", "rank"], how="left")
    sub = sub.with_columns(comm_size=pl.col("comm_ranks").list.len())
    if sync and prefix is None:
        sub = sub.with_columns(op=pl.when(pl.col("op") == "compute").then(pl.lit("other")).otherwise(pl.col("op")))
    return sub


def load(path: Path) -> pa.Table:
    """Read a per-operation CSV/Parquet table into a conformed operations table."""
    path = Path(path)
    if not path.is_file():
        raise EvidenceError(f"{path}: not a file")
    df = _read(path)
    mapping = map_columns(df.columns)
    missing = [c for c in _REQUIRED if c not in mapping]
    if missing:
        raise EvidenceError(f"{path}: no column for {', '.join(missing)} (accepted names: see docs/semantic.md)")
    if "end" not in mapping and "duration" not in mapping:
        raise EvidenceError(f"{path}: needs an end time or a duration column")
    if df.height == 0:
        raise EvidenceError(f"{path}: the table has no rows")

    def col(name: str) -> pl.Series:
        return df.get_column(mapping[name])

    try:
        rank = col("rank").cast(pl.Int32, strict=True)
    except Exception as exc:
        raise EvidenceError(f"{path}: rank column {mapping['rank']!r} is not a whole number in range") from exc
    if rank.null_count() or (rank < 0).any():
        raise EvidenceError(f"{path}: rank column {mapping['rank']!r} has missing or negative values")
    label = col("op").cast(pl.String)
    if label.null_count():
        raise EvidenceError(f"{path}: operation column {mapping['op']!r} has missing values")
    if int(label.str.len_chars().max() or 0) > MAX_LABEL_CHARS:  # type: ignore[arg-type]
        raise EvidenceError(f"{path}: an operation name is longer than {MAX_LABEL_CHARS} characters")
    start = _times_ns(df, mapping["start"], path)
    if "end" in mapping:  # noqa: SIM108 - two sources, said plainly
        end = _times_ns(df, mapping["end"], path)
    else:
        end = start + _times_ns(df, mapping["duration"], path)
    if np.any(end < start):
        raise EvidenceError(f"{path}: {int(np.sum(end < start))} rows end before they start")

    frame = pl.DataFrame({"rank": rank, "label": label, "start_ns": start, "end_ns": end})
    ops = {name: normalise_op(name) for name in label.unique().to_list()}  # per distinct name, not per row
    frame = frame.with_columns(op=pl.col("label").replace_strict(ops, return_dtype=pl.String))
    if "enqueue" in mapping:
        frame = frame.with_columns(enqueue_ns=pl.Series(_times_ns(df, mapping["enqueue"], path)))
    for name in ("step", "seq", "comm_size", "bytes", "count", "peer", *_COORDS):
        if name in mapping:
            try:
                frame = frame.with_columns(col(name).cast(pl.Int64, strict=True).alias(name))
            except Exception as exc:
                raise EvidenceError(f"{path}: column {mapping[name]!r} is not whole numbers") from exc
    for name in ("comm_id", "comm_name", "comm_desc", "dtype", "node", "host"):
        if name in mapping:
            frame = frame.with_columns(col(name).cast(pl.String).alias(name))
    frame = frame.with_columns(record_id=pl.int_range(pl.len(), dtype=pl.Int64))

    if "step" in frame.columns and frame.get_column("step").null_count() == 0:
        s, e = lay_steps_end_to_end(
            frame.get_column("step").to_numpy(),
            frame.get_column("start_ns").to_numpy(),
            frame.get_column("end_ns").to_numpy(),
        )
        shift = s - frame.get_column("start_ns").to_numpy()
        frame = frame.with_columns(start_ns=pl.Series(s), end_ns=pl.Series(e))
        if "enqueue_ns" in frame.columns:
            frame = frame.with_columns(enqueue_ns=pl.col("enqueue_ns") + pl.Series(shift))

    coords = [c for c in _COORDS if c in frame.columns and frame.get_column(c).null_count() == 0]
    if "comm_id" not in frame.columns:
        frame = _infer_communicators(frame, coords)
        frame = frame.with_columns(comm_name=pl.col("label"))
    else:
        frame = frame.with_columns(pl.col("comm_id").fill_null("unknown"))
        if "comm_name" not in frame.columns:
            frame = frame.with_columns(comm_name=pl.col("label"))
    frame = frame.sort("rank", "start_ns", "record_id")
    frame = _renumber_seq(frame)
    frame = frame.with_columns(
        is_p2p=pl.col("op").is_in(["send", "recv"]),
        state=pl.lit("completed"),
        source=pl.lit("table"),
        seq_kind=pl.when(pl.col("op").is_in(["send", "recv"])).then(pl.lit("p2p")).otherwise(pl.lit("comm")),
    )
    bad = set(frame.get_column("op").unique().to_list()) - set(OPS)
    if bad:  # pragma: no cover - normalise_op only returns OPS
        raise EvidenceError(f"{path}: unknown ops {sorted(bad)}")
    keep = [c for c in frame.columns if c not in ("label",)]
    try:
        return conform(frame.select(keep).to_arrow())
    except ValueError as exc:
        raise EvidenceError(f"{path}: {exc}") from exc


def _renumber_seq(frame: pl.DataFrame) -> pl.DataFrame:
    """Keep a source seq only when it strictly increases per (rank, communicator); else count."""
    running = (pl.col("start_ns").cum_count().over(["rank", "comm_id", "is_p2p_tmp"]) - 1).cast(pl.Int64)
    frame = frame.with_columns(is_p2p_tmp=pl.col("op").is_in(["send", "recv"]))
    if "seq" in frame.columns and frame.get_column("seq").null_count() == 0:
        ok = frame.select((pl.col("seq").diff().over(["rank", "comm_id", "is_p2p_tmp"]).fill_null(1) > 0).all()).item()
        if ok:
            return frame.drop("is_p2p_tmp")
    return frame.with_columns(seq=running).drop("is_p2p_tmp")


register(Importer(name="table", detect=detect, load=load))
