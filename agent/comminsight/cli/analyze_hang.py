"""``comminsight analyze hang PATH [--format json|text]``: where did progress stop first?"""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from comminsight.cli.errors import fail
from comminsight.cli.importer import load_evidence

if TYPE_CHECKING:
    from rich.console import Console


class OutputFormat(str, Enum):
    text = "text"
    json = "json"


def hang_command(
    path: Path = typer.Argument(..., help="Evidence: FR dumps, Kineto traces, raw logs, an imported .parquet, ..."),
    output_format: OutputFormat = typer.Option(OutputFormat.text, "--format", help="text (for people) or json"),
    input_format: str | None = typer.Option(None, "--input-format", help="Force an importer by name"),
    silence_s: float = typer.Option(60.0, help="A rank silent this long before the last event 'stopped reporting'"),
) -> None:
    """Find the stuck communicators and the ranks where progress stopped first."""
    from comminsight.analysis.hang import analyze_hang
    from comminsight.analysis.hang_report import render_text
    from comminsight.evidence.process_groups import naming_of
    from comminsight.importers import EvidenceError

    try:
        table = load_evidence(path, input_format)
    except EvidenceError as exc:
        fail(exc)
    report = analyze_hang(table, silence_s=silence_s)
    naming = naming_of(table)
    if naming is not None:
        report["names"] = naming
    if output_format is OutputFormat.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        from rich.console import Console

        # Wide enough for the evidence table when piped (rich falls back to 80 columns otherwise).
        console = Console(width=None if sys.stdout.isatty() else 160)
        render_text(report, console)
        render_naming(naming, console)


def render_naming(naming: dict | None, console: Console) -> None:
    """One line on communicator names: how they were found, or why they are missing."""
    if not naming or not naming.get("communicators"):
        return
    if naming.get("reason"):
        console.print(
            f"Communicator names: {naming['named']} of {naming['communicators']} named; {naming['reason']}",
            highlight=False,
        )
    for note in naming.get("ambiguous", []):
        console.print(f"Communicator names: {note}", highlight=False)


def register(app: typer.Typer) -> None:
    """Mount the hang/failure analysis commands on ``app``."""
    app.command("hang")(hang_command)
