"""``comminsight agent``: the node agent daemon and its local views."""

import typer

app = typer.Typer(help="Run and inspect the node agent.", no_args_is_help=True)
