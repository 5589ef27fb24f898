"""Shape stored analysis reports into rows the result templates show (no computation beyond regrouping)."""

from __future__ import annotations

from typing import Any

from comminsight_site.charts import (
    bandwidth_option,
    hang_chain_option,
    size_label,
    step_times_option,
    straggler_attribution_option,
)

from .models import AnalysisKind, StepCalibration
from .services import calibrated_steps

MAX_ROWS = 2000  # the page shows this many rows per table; the API has everything


def _ranks(ranks: list[Any] | None, limit: int = 16) -> str:
    if not ranks:
        return "—"
    text = ", ".join(map(str, ranks[:limit]))
    return text + (f" (+{len(ranks) - limit})" if len(ranks) > limit else "")


def hang_view(result: dict[str, Any]) -> dict[str, Any]:
    evidence = result.get("evidence") or {}
    roots = []
    for rank in result.get("root_cause_ranks", [])[:64]:
        item = evidence.get(str(rank)) or {}
        last = item.get("last_op") or {}
        roots.append(
            {
                "rank": rank,
                "status": item.get("status", "—"),
                "last_op": (
                    f"{last.get('op')} seq {last.get('seq')} in {last.get('group_desc') or last.get('group_id')} "
                    f"({last.get('state')})"
                    if last
                    else "no evidence"
                ),
                "missing_from": ", ".join(item.get("missing_from") or []) or "—",
                "completions_lag_in": ", ".join(item.get("completions_lag_in") or []) or "—",
            }
        )
    groups = []
    for group in result.get("stuck_groups", [])[:MAX_ROWS]:
        why = str(group.get("kind", "")).replace("_", " ")
        if group.get("lagging_ranks"):
            why += f"; completions lag on {_ranks(group['lagging_ranks'], 6)}"
        if group.get("mismatch"):
            why += "; differs in " + ", ".join(group["mismatch"])
        groups.append(
            {
                "group": group.get("group_id"),
                "desc": group.get("group_desc") or "",
                "op": group.get("op") or "—",
                "seq": group.get("seq"),
                "dtype": group.get("dtype") or "—",
                "entered": _ranks(group.get("entered_ranks")),
                "missing": _ranks(group.get("missing_ranks")),
                "why": why,
            }
        )
    chain = []
    for link in result.get("chain", [])[:200]:
        blocks = link.get("blocks") or []
        text = "; ".join(
            f"blocks {b.get('group_desc') or b.get('group_id')} {b.get('op')} seq {b.get('seq')}: "
            f"waiting {_ranks(b.get('waiting_ranks'), 8)}"
            for b in blocks[:6]
        )
        chain.append({"rank": link.get("rank"), "indent": int(link.get("depth", 0)) * 1.5, "text": text})
    failures = result.get("failures") or {}
    return {
        "verdict": result.get("verdict", "unknown"),
        "summary": result.get("summary", ""),
        "root_cause_ranks": result.get("root_cause_ranks", []),
        "roots": roots,
        "groups": groups,
        "groups_total": len(result.get("stuck_groups", [])),
        "chain": chain,
        "failures": [
            (label, _ranks(failures.get(key), 32))
            for key, label in (
                ("no_evidence_ranks", "Ranks with no evidence at all"),
                ("stopped_reporting_ranks", "Ranks that stopped reporting early"),
                ("stalled_completion_ranks", "Ranks that did not complete operations their peers completed"),
            )
            if failures.get(key)
        ],
        "mismatches": result.get("mismatches", [])[:20],
    }


def steps_view(result: dict[str, Any], calibration: StepCalibration | None) -> dict[str, Any]:
    rows = calibrated_steps(result, calibration)
    t0 = rows[0]["start_ns"] if rows and rows[0]["start_ns"] is not None else 0
    for row in rows:
        row["start_ms"] = (row["start_ns"] - t0) / 1e6 if row["start_ns"] is not None else None
    durations = [r["duration_ms"] for r in rows if r["duration_ms"] is not None]
    return {
        "method": result.get("method"),
        "agreement": result.get("agreement"),
        "rows": rows[:MAX_ROWS],
        "total": len(rows),
        "mean_ms": sum(durations) / len(durations) if durations else None,
        "calibration": calibration,
    }


def _heatmap_option(heatmap: dict[str, Any]) -> dict[str, Any] | None:
    """ECharts option: rank x step, the step time each rank's own slowness adds (ms)."""
    ranks, steps, delay = heatmap.get("ranks") or [], heatmap.get("steps") or [], heatmap.get("delay_ms") or []
    if not ranks or not steps:
        return None
    ranks, delay = ranks[:MAX_ROWS], delay[:MAX_ROWS]
    cells = [[j, i, round(v, 2)] for i, row in enumerate(delay) for j, v in enumerate(row)]
    top = max((c[2] for c in cells), default=0.0)
    return {
        "tooltip": {"position": "top"},
        "grid": {"left": 60, "right": 20, "top": 20, "bottom": 95},
        "xAxis": {"type": "category", "name": "step", "nameLocation": "middle", "nameGap": 28, "data": steps},
        "yAxis": {"type": "category", "name": "rank", "data": ranks},
        "visualMap": {
            "min": 0,
            "max": max(top, 0.001),
            "calculable": True,
            "orient": "horizontal",
            "left": "center",
            "bottom": 0,
            "text": ["ms added", ""],
        },
        "series": [{"name": "attributable delay (ms)", "type": "heatmap", "data": cells}],
    }


def _per_step_option(per_step: list[dict[str, Any]]) -> dict[str, Any] | None:
    """ECharts option: observed, ideal and without-culprits step time per step (ms)."""
    if not per_step:
        return None
    steps = [s["step"] for s in per_step]
    series = [
        ("observed", "duration_ms"),
        ("without culprits", "without_culprits_ms"),
        ("ideal", "ideal_ms"),
    ]
    return {
        "tooltip": {"trigger": "axis"},
        "legend": {"top": 0},
        "grid": {"left": 60, "right": 20, "top": 30, "bottom": 40},
        "xAxis": {"type": "category", "name": "step", "nameLocation": "middle", "nameGap": 28, "data": steps},
        "yAxis": {"type": "value", "name": "ms"},
        "series": [
            {"name": label, "type": "line", "data": [round(s.get(key) or 0.0, 2) for s in per_step]}
            for label, key in series
            if any(key in s for s in per_step)
        ],
    }


def stragglers_view(result: dict[str, Any]) -> dict[str, Any]:
    evidence = result.get("evidence") or "ok"
    return {
        "evidence": evidence,
        "answerable": evidence == "ok",
        "heatmap_option": _heatmap_option(result.get("heatmap") or {}),
        "per_step_option": _per_step_option(result.get("per_step") or []),
        "attribution": [
            (kind, entries[:MAX_ROWS]) for kind, entries in (result.get("attribution") or {}).items() if entries
        ],
        "ranks": result.get("ranks", [])[:MAX_ROWS],
        "culprits": result.get("culprits", []),
        "culprit_groups": result.get("culprit_groups", []),
        "slowdown": result.get("slowdown") or {},
        "waiting": result.get("waiting", [])[:20],
        "step_source": result.get("step_source", ""),
        "by_coordinate": [
            (coord, sorted(values.items())) for coord, values in (result.get("by_coordinate") or {}).items()
        ],
    }


_LABELS = {
    "comm_id": "Communicator",
    "op": "Op",
    "rank": "Rank",
    "n": "Ranks",
    "samples": "Samples",
    "busbw_gbs": "Bus bandwidth (GB/s)",
    "reference_busbw_gbs": "Best (GB/s)",
    "efficiency": "Of best",
    "algbw_gbs": "Algorithm bandwidth (GB/s)",
    "transfer_us": "Transfer (µs)",
}


def _cell(key: str, value: Any) -> str:
    """One value as people read it: rounded numbers, shares as percentages, sizes in bytes units."""
    if value is None:
        return "—"
    if key == "efficiency" and isinstance(value, int | float):
        return f"{100 * value:.0f}%"
    if key in ("bytes", "size") and isinstance(value, int | float):
        return size_label(value)
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, list):
        return _ranks(value)
    return str(value)


def _flagged_table(items: list[dict[str, Any]], comm_names: dict[str, str]) -> dict[str, Any]:
    """Flagged items (their fields vary by kind) as a readable table: sizes instead of bucket numbers, names
    instead of hashes where known, percentages, rounded bandwidths; statistics nobody reads are left out."""
    hidden = {"bucket", "busbw_p10_gbs"}
    columns: list[str] = []
    for item in items[:50]:
        columns += [k for k in item if k not in columns and k not in hidden]
    if any("bucket" in item or "bytes" in item for item in items[:50]):
        columns = [c for c in columns if c != "bytes"]
        columns.insert(min(2, len(columns)), "size")
    rows = []
    for item in items[:200]:
        row = []
        for column in columns:
            if column == "size":
                size = item.get("bytes") or (2 ** int(item["bucket"]) if item.get("bucket") is not None else None)
                row.append(_cell("size", size))
            elif column == "comm_id":
                row.append(comm_names.get(str(item.get(column))) or str(item.get(column)))
            else:
                row.append(_cell(column, item.get(column)))
        rows.append(row)
    labels = [_LABELS.get(c, "Size" if c == "size" else c.replace("_", " ").capitalize()) for c in columns]
    return {"columns": labels, "rows": rows}


def _links(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Slow links between two different ranks (a rank's transfers to itself are not a link)."""
    rows = []
    for link in items:
        if link.get("src") == link.get("dst"):
            continue
        size = 2 ** int(link["bucket"]) if link.get("bucket") is not None else None
        rows.append(
            {
                "src": link.get("src"),
                "dst": link.get("dst"),
                "size": _cell("size", size),
                "samples": link.get("samples"),
                "busbw": _cell("busbw_gbs", link.get("busbw_gbs")),
                "best": _cell("reference_busbw_gbs", link.get("reference_busbw_gbs")),
                "efficiency": _cell("efficiency", link.get("efficiency")),
            }
        )
    return rows[:200]


def perf_view(
    result: dict[str, Any], comm_names: dict[str, str] | None = None, parameters: dict[str, Any] | None = None
) -> dict[str, Any]:
    comm_names = comm_names or {}
    rows = []
    for r in result.get("bandwidth", [])[:MAX_ROWS]:
        rows.append(
            {
                **r,
                "bucket_bytes": 2 ** int(r["bucket"]) if r.get("bucket") is not None else None,
                "name": comm_names.get(str(r.get("comm_id"))) or "",
            }
        )
    flagged = [
        (title, _flagged_table(result.get(key) or [], comm_names))
        for key, title in (("slow_communicators", "Slow communicators"), ("slow_ranks", "Slow ranks"))
        if result.get(key)
    ]
    slow_fraction = result.get("slow_fraction")
    if slow_fraction is None:
        slow_fraction = (parameters or {}).get("slow_fraction")
    return {
        "bandwidth": rows,
        "flagged": flagged,
        "links": _links(result.get("slow_links") or []),
        "note": result.get("note", ""),
        "slow_fraction": slow_fraction,
        "chart": bandwidth_option(result, comm_names),
    }


def report_view(
    kind: str,
    result: dict[str, Any],
    calibration: StepCalibration | None,
    comm_names: dict[str, str] | None = None,
    parameters: dict[str, Any] | None = None,
) -> dict[str, Any]:
    if kind == AnalysisKind.HANG:
        return {**hang_view(result), "chart": hang_chain_option(result)}
    if kind == AnalysisKind.STEPS:
        view = steps_view(result, calibration)
        return {**view, "chart": step_times_option(result.get("steps") or [], calibration.offset if calibration else 0)}
    if kind == AnalysisKind.STRAGGLERS:
        return {**stragglers_view(result), "chart": straggler_attribution_option(result)}
    return perf_view(result, comm_names, parameters)
