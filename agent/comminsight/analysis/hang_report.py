"""Rendering a hang report (analysis.hang.analyze_hang's dict) as text for an engineer.

Verdict first, then the evidence table (stuck groups, then the root-cause ranks' own state),
then the dependency chain. Rendering uses rich so it can go to a terminal or be captured.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from comminsight.importers.normalise import shape_display

_VERDICT_STYLE = {"hang": "bold red", "no_hang": "bold green", "insufficient_evidence": "bold yellow"}
_MAX_GROUPS = 25


def _ranks(ranks: list[int], limit: int = 12) -> str:
    if not ranks:
        return "-"
    text = ", ".join(map(str, ranks[:limit]))
    return text + (f" (+{len(ranks) - limit})" if len(ranks) > limit else "")


def _group_name(group: dict[str, Any]) -> str:
    desc = group.get("group_desc")
    return f"{group['group_id']} {desc}" if desc else str(group["group_id"])


def render_text(report: dict[str, Any], console: Console) -> None:
    """Print ``report`` on ``console``: verdict, evidence table, chain."""
    verdict = report["verdict"]
    console.print(f"[{_VERDICT_STYLE.get(verdict, 'bold')}]Verdict: {verdict}[/]", highlight=False)
    console.print(report.get("summary", ""), highlight=False)
    roots = report.get("root_cause_ranks", [])
    if roots:
        console.print(f"Look first at rank(s): [bold]{_ranks(roots, 32)}[/bold]", highlight=False)

    groups = report.get("stuck_groups", [])
    if groups:
        table = Table(title=f"Stuck groups ({len(groups)})", title_justify="left")
        for column in ("group", "op", "seq", "shape", "dtype", "entered", "missing", "why"):
            table.add_column(column, overflow="fold")
        for group in groups[:_MAX_GROUPS]:
            why = group["kind"].replace("_", " ")
            if group.get("lagging_ranks"):
                why += f"; completions lag on {_ranks(group['lagging_ranks'], 6)}"
            if group.get("mismatch"):
                why += "; differs in " + ", ".join(group["mismatch"])
            if group.get("blocked_earlier_ranks"):
                why += f"; {_ranks(group['blocked_earlier_ranks'], 6)} still in an earlier op"
            table.add_row(
                _group_name(group),
                str(group.get("op") or "-"),
                str(group.get("seq") if group.get("seq") is not None else "-"),
                shape_display(group.get("shape")) or "-",
                group.get("dtype") or "-",
                _ranks(group.get("entered_ranks", [])),
                _ranks(group.get("missing_ranks", [])),
                why,
            )
        if len(groups) > _MAX_GROUPS:
            table.caption = f"{len(groups) - _MAX_GROUPS} more in --format json"
        console.print(table)

    evidence = report.get("evidence", {})
    names = {g["group_id"]: g["group_desc"] for g in groups if g.get("group_desc")}
    shown = roots[:16]
    if shown:
        table = Table(title="Root-cause ranks: what each was doing last", title_justify="left")
        for column in ("rank", "status", "last op", "missing from", "completions lag in"):
            table.add_column(column, overflow="fold")
        for rank in shown:
            item = evidence.get(str(rank), {})
            last = item.get("last_op") or {}
            last_text = (
                f"{last.get('op')} seq {last.get('seq')} in {last.get('group_desc') or last.get('group_id')} "
                f"({last.get('state')})"
                if last
                else "no evidence"
            )
            table.add_row(
                str(rank),
                item.get("status", "-"),
                last_text,
                ", ".join(names.get(g, g) for g in item.get("missing_from", [])) or "-",
                ", ".join(names.get(g, g) for g in item.get("completions_lag_in", [])) or "-",
            )
        console.print(table)

    failures = report.get("failures", {})
    for key, label in (
        ("no_evidence_ranks", "Ranks with no evidence at all"),
        ("stopped_reporting_ranks", "Ranks that stopped reporting early (crashed, killed or stuck outside NCCL)"),
        ("stalled_completion_ranks", "Ranks that did not complete operations their peers completed"),
    ):
        if failures.get(key):
            console.print(f"{label}: {_ranks(failures[key], 32)}", highlight=False)
    if failures.get("abandoned_ops"):
        per_rank = sorted(failures["abandoned_ops"].items(), key=lambda item: int(item[0]))
        text = ", ".join(f"rank {rank}: {count}" for rank, count in per_rank[:32])
        console.print(f"Operations abandoned at abort/finalize: {text}", highlight=False)
    for item in report.get("mismatches", [])[:5]:
        console.print(
            f"Mismatch in {item['group_desc'] or item['group_id']} seq {item['seq']}: {item['fields']}", highlight=False
        )

    chain = report.get("chain", [])
    if chain:
        console.print("[bold]Dependency chain[/bold] (who waits on whom, from where progress stopped):")
        paths = [" -> ".join(map(str, path)) for path in report.get("wait_paths", [])[:8] if len(path) > 1]
        if paths:
            console.print("  Wait paths (each rank waits on the next): " + "; ".join(paths), highlight=False)
        for link in _tree_order(chain[:40]):
            indent = "  " * (link["depth"] + 1)
            who = f"rank {link['rank']}"
            if link.get("waits_on") is not None:
                who += f" (waits on {link['waits_on']})"
            if not link["blocks"]:
                console.print(f"{indent}{who}", highlight=False)
                continue
            for block in link["blocks"][:6]:
                console.print(
                    f"{indent}{who} blocks {block['group_desc'] or block['group_id']} "
                    f"{block['op']} seq {block['seq']}: waiting {_ranks(block['waiting_ranks'], 8)}",
                    highlight=False,
                )


def _tree_order(chain: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chain (breadth first in the report) depth first, so each rank is printed under the one it waits on."""
    children: dict[int | None, list[dict[str, Any]]] = {}
    ranks = {link["rank"] for link in chain}
    for link in chain:
        parent = link.get("waits_on")
        children.setdefault(parent if parent in ranks else None, []).append(link)
    ordered: list[dict[str, Any]] = []
    stack = list(reversed(children.get(None, [])))
    while stack:
        link = stack.pop()
        ordered.append(link)
        stack.extend(reversed(children.get(link["rank"], [])))
    return ordered


def summary_sentence(verdict: str, roots: list[int], groups: list[dict], no_evidence: list[int], n_world: int) -> str:
    """The report's one-sentence summary."""
    if verdict == "no_hang":
        return f"No hang: every operation entered by the {n_world} ranks in the evidence completed."
    if verdict == "insufficient_evidence" and not no_evidence:
        return "No operations or progress counters in the evidence, only group membership."
    if verdict == "insufficient_evidence":
        return f"No stuck operation seen, but {len(no_evidence)} member rank(s) left no evidence: " + ", ".join(
            map(str, no_evidence[:16])
        )
    first = groups[0]
    where = f"{first['group_desc'] or first['group_id']} {first['op']} seq {first['seq']}"
    shape = shape_display(first.get("shape"))
    if shape:
        where += f" ({shape} {first.get('dtype') or ''})".rstrip()
    if roots:
        who = ", ".join(map(str, roots[:16]))
        return f"Hang: progress stopped first at rank(s) {who}; first stuck group {where}."
    return f"Hang: {len(groups)} stuck group(s), first {where}; no single rank stands out."
