"""``comminsight analyze``: the analyses. Each analysis module registers its own command here."""

import typer

from comminsight.cli import analyze_hang, analyze_semantic

app = typer.Typer(help="Analyse evidence: hangs, steps, stragglers, communication performance.", no_args_is_help=True)
analyze_hang.register(app)
analyze_semantic.register(app)
