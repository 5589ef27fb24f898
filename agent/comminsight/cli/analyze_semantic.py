"""``comminsight analyze steps|stragglers|perf PATH [--format json|text]``.

Each command loads PATH through the importers, calls one analysis function and renders its
result; the analyses themselves live in comminsight.semantic and comminsight.analysis. The
libraries a command uses (polars, the importers, rich for text output) are imported by that
command: the command line mounts this module at start.
"""

from __future__ import annotations

import json
import sys
from contextlib import AbstractContextManager, nullcontext
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from comminsight.cli.errors import fail
from comminsight.cli.importer import load_evidence

if TYPE_CHECKING:
    import polars as pl
    from rich.console import Console


class OutputFormat(str, Enum):
    text = "text"
    json = "json"


def _status(message: str) -> AbstractContextManager:
    """A spinner on stderr while ``message`` is being done, on a terminal only (where rich draws one)."""
    if not sys.stderr.isatty():
        return nullcontext()
    from rich.console import Console

    return Console(stderr=True).status(message)


def _load(path: Path, input_format: str | None) -> pl.DataFrame:
    import polars as pl

    from comminsight.importers import EvidenceError

    try:
        with _status(f"loading {path}"):
            table = load_evidence(path, input_format)
    except EvidenceError as exc:
        fail(exc)
    df = pl.from_arrow(table)
    assert isinstance(df, pl.DataFrame)
    if df.height == 0:
        fail(f"{path}: no operations")
    return df


def _emit_json(doc: dict) -> None:
    json.dump(doc, sys.stdout, indent=2, default=float)
    sys.stdout.write("\n")


def _console() -> Console:
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160)


def steps_command(
    path: Path = typer.Argument(..., help="Evidence: a per-op table, FR dumps, Kineto traces, raw logs, ..."),
    output_format: OutputFormat = typer.Option(OutputFormat.text, "--format", help="text or json"),
    input_format: str | None = typer.Option(None, "--input-format", help="Force an importer by name"),
    template: list[Path] = typer.Option([], "--template", help="Extra template file(s) (docs/semantic.md)"),
    no_templates: bool = typer.Option(False, "--period-only", help="Skip templates; use period detection"),
    calibrate: str | None = typer.Option(None, "--calibrate", help="K:N maps recovered step K to framework step N"),
    ignore_labels: bool = typer.Option(False, "--ignore-labels", help="Do not compare with the input's step labels"),
) -> None:
    """Recover training steps from communication alone."""
    import polars as pl

    from comminsight.semantic import StepCalibration, TemplateError, builtin_templates, load_template, recover_steps

    try:
        templates = [load_template(p) for p in template] + builtin_templates()
    except TemplateError as exc:
        fail(exc)
    calibration = None
    if calibrate:
        try:
            k, n = (int(x) for x in calibrate.split(":"))
        except ValueError:
            fail("--calibrate takes K:N, two whole numbers")
        calibration = StepCalibration.from_pair(k, n)
    df = _load(path, input_format)
    if ignore_labels:
        df = df.with_columns(step=pl.lit(None, dtype=pl.Int64))
    with _status("recovering steps"):
        report = recover_steps(
            df, templates=templates, use_templates=not no_templates, calibration=calibration, compute_waits=True
        )
    doc = {
        "method": report.method,
        "methods_by_rank": {str(k): v for k, v in sorted(report.methods_by_rank.items())},
        "steps": report.steps,
    }
    if report.agreement is not None:
        doc["agreement"] = report.agreement
    if output_format is OutputFormat.json:
        _emit_json(doc)
        return
    from rich.table import Table

    out = _console()
    out.print(f"method: [bold]{report.method}[/bold]   steps: {len(report.steps)}")
    if report.agreement:
        a = report.agreement
        out.print(
            f"agreement with step labels: {a['event_agreement']:.1%} of events; "
            f"{a['steps_recovered']} recovered vs {a['steps_labelled']} labelled; one-to-one: {a['one_to_one']}"
        )
    grid = Table("step", "start (ms)", "duration (ms)", "ranks", "comm (ms, mean per rank)", "exposed wait (ms)")
    t0 = report.steps[0]["start_ns"] if report.steps else 0
    for s in report.steps:
        ranks = s["ranks"].values()
        comm = sum(sum(r["comm_ms"].values()) for r in ranks) / max(len(ranks), 1)
        wait = sum(r["exposed_wait_ms"] for r in ranks) / max(len(ranks), 1)
        grid.add_row(
            str(s["step"]),
            f"{(s['start_ns'] - t0) / 1e6:.1f}",
            f"{s['duration_ms']:.1f}",
            str(len(ranks)),
            f"{comm:.1f}",
            f"{wait:.1f}",
        )
    out.print(grid)


def stragglers_command(
    path: Path = typer.Argument(..., help="Evidence: a per-op table, FR dumps, Kineto traces, raw logs, ..."),
    output_format: OutputFormat = typer.Option(OutputFormat.text, "--format", help="text or json"),
    input_format: str | None = typer.Option(None, "--input-format", help="Force an importer by name"),
    ignore_labels: bool = typer.Option(False, "--ignore-labels", help="Use recovered steps even when labels exist"),
    min_gain: float = typer.Option(0.005, help="Resolution: no culprit saving less than this share of the step"),
) -> None:
    """Find the ranks that make steps slow, and how much faster the job would be without them."""
    from comminsight.analysis.stragglers import analyse_stragglers

    df = _load(path, input_format)
    with _status("matching operations and replaying steps"):
        report = analyse_stragglers(df, use_labels=not ignore_labels, min_gain=min_gain)
    doc = report.to_dict()
    if output_format is OutputFormat.json:
        _emit_json(doc)
        return
    from rich.table import Table

    out = _console()
    sd = report.slowdown
    if report.evidence != "ok":
        out.print(f"[yellow]cannot answer:[/yellow] {report.evidence}")
        return
    out.print(
        f"steps: {sd['steps']} ({report.step_source})   mean step: {sd['observed_step_ms']:.1f} ms   "
        f"ideal: {sd['ideal_step_ms']:.1f} ms (slowdown x{sd['ratio']:.3f})"
    )
    if report.culprits:
        groups = ", ".join(
            f"{g['group']} (ranks {g['ranks']}, saves {g['saves_ms_per_step']:.1f} ms/step)"
            for g in report.culprit_groups
        )
        out.print(f"[bold red]culprits:[/bold red] {report.culprits}  <- {groups}")
        out.print(
            f"estimated step without them: {sd['estimated_without_culprits_ms']:.1f} ms "
            f"(they slow it x{sd['without_culprits_ratio']:.3f})"
        )
    else:
        out.print("[green]no straggler: nothing stands out from the job's own noise[/green]")
    kinds = Table("attribution", "subset", "slowdown ratio (only it slow)", "share")
    for kind, entries in report.attribution.items():
        for e in entries[:3]:
            kinds.add_row(kind, str(e["subset"]), f"x{e['slowdown_ratio']:.3f}", f"{e['share']:.2f}")
    out.print(kinds)
    grid = Table("rank", "straggler index", "arrival score", "mean lateness (ms)", "waiting (ms)", "compute-gap growth")
    for r in report.ranks:
        grid.add_row(
            str(r["rank"]),
            f"{r['straggler_index']:.3f}",
            f"{r['arrival_score']:+.2f}",
            f"{r['mean_lateness_ms']:.2f}",
            f"{r['waiting_ms']:.1f}",
            f"{r['compute_gap_growth']:+.2f}",
        )
    out.print(grid)
    for coord, values in report.by_coordinate.items():
        parts = ", ".join(f"{coord}={v}: x{d['slowdown_ratio']:.3f}" for v, d in sorted(values.items()))
        out.print(f"slowdown if not slow, by {coord}: {parts}")
    if report.waiting_edges:
        top = report.waiting_edges[:5]
        out.print(
            "who waited for whom: " + "; ".join(f"{e['waiter']}->{e['waited_for']} {e['wait_ms']:.0f} ms" for e in top)
        )


def perf_command(
    path: Path = typer.Argument(..., help="Evidence: a per-op table, FR dumps, Kineto traces, raw logs, ..."),
    output_format: OutputFormat = typer.Option(OutputFormat.text, "--format", help="text or json"),
    input_format: str | None = typer.Option(None, "--input-format", help="Force an importer by name"),
    slow_fraction: float = typer.Option(0.5, help="Flag below this share of the best observed bus bandwidth"),
) -> None:
    """Algorithm and bus bandwidth per communicator, op and size; slow communicators, ranks and links."""
    from comminsight.analysis.perf import analyse_perf

    df = _load(path, input_format)
    report = analyse_perf(df, slow_fraction=slow_fraction)
    if output_format is OutputFormat.json:
        _emit_json(report)
        return
    from rich.table import Table

    out = _console()
    if not report["bandwidth"]:
        out.print(report.get("note", "no bandwidth data"))
        return
    grid = Table("communicator", "op", "size <=", "n", "samples", "algbw GB/s", "busbw GB/s", "best GB/s", "efficiency")
    for r in report["bandwidth"]:
        grid.add_row(
            str(r["comm_id"]),
            r["op"],
            f"2^{r['bucket']}",
            str(r["n"]),
            str(r["samples"]),
            f"{r['algbw_gbs']:.2f}",
            f"{r['busbw_gbs']:.2f}",
            f"{(r['reference_busbw_gbs'] or 0):.2f}",
            f"{(r['efficiency'] or 0):.0%}",
        )
    out.print(grid)
    for key, title in (
        ("slow_communicators", "slow communicators"),
        ("slow_ranks", "slow ranks"),
        ("slow_links", "slow links"),
    ):
        if report[key]:
            out.print(f"[bold red]{title}:[/bold red] {json.dumps(report[key], default=float)}")


def register(app: typer.Typer) -> None:
    """Mount the step, straggler and performance commands on ``app``."""
    app.command("steps")(steps_command)
    app.command("stragglers")(stragglers_command)
    app.command("perf")(perf_command)
