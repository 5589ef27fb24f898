"""Shape stored analysis reports into rows the result templates show (no computation beyond regrouping)."""

from __future__ import annotations

from typing import Any

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


def stragglers_view(result: dict[str, Any]) -> dict[str, Any]:
    return {
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


def _generic(items: list[dict[str, Any]]) -> dict[str, Any]:
    """A list of flat dicts as a table (flagged items' fields vary by kind)."""
    columns: list[str] = []
    for item in items[:50]:
        columns += [k for k in item if k not in columns]
    return {"columns": columns, "rows": [[item.get(c) for c in columns] for item in items[:200]]}


def perf_view(result: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for r in result.get("bandwidth", [])[:MAX_ROWS]:
        rows.append({**r, "bucket_bytes": 2 ** int(r["bucket"]) if r.get("bucket") is not None else None})
    flagged = [
        (title, _generic(result.get(key) or []))
        for key, title in (
            ("slow_communicators", "Slow communicators"),
            ("slow_ranks", "Slow ranks"),
            ("slow_links", "Slow links"),
        )
        if result.get(key)
    ]
    return {
        "bandwidth": rows,
        "flagged": flagged,
        "note": result.get("note", ""),
        "slow_fraction": result.get("slow_fraction"),
    }


def report_view(kind: str, result: dict[str, Any], calibration: StepCalibration | None) -> dict[str, Any]:
    if kind == AnalysisKind.HANG:
        return hang_view(result)
    if kind == AnalysisKind.STEPS:
        return steps_view(result, calibration)
    if kind == AnalysisKind.STRAGGLERS:
        return stragglers_view(result)
    return perf_view(result)
