"""``comminsight simulate``: drive the real profiler plugin as NCCL would, one process per rank."""

import typer

app = typer.Typer(help="Simulate a training job through the real profiler plugin.", no_args_is_help=True)
