"""``comminsight inject install|status|uninstall [--python PATH]``: the import hook in a workload's environment.

Thin wrapper over ``comminsight_inject.installer`` (the same commands as ``python -m comminsight_inject``).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import typer

from comminsight.cli.errors import fail

if TYPE_CHECKING:
    from comminsight_inject import installer

app = typer.Typer(
    help="Install the PyTorch import hook that names communicators into a workload's Python environment.",
    no_args_is_help=True,
)
PYTHON = typer.Option(None, "--python", help="The workload's interpreter (default: the one running this command)")


def _fail(exc: installer.InstallError) -> None:
    fail(exc)


@app.command("install")
def install_command(python: str | None = PYTHON) -> None:
    """Put the .pth file and the deferred hook into the environment (venv, else user site)."""
    from comminsight_inject import installer

    try:
        target, installed = installer.install(python)
    except installer.InstallError as exc:
        _fail(exc)
        return
    typer.echo(f"installed into {target.site_dir} ({target.kind} of {target.executable}):")
    for path in installed.files:
        typer.echo(f"  {path}")


@app.command("status")
def status_command(python: str | None = PYTHON, as_json: bool = typer.Option(False, "--json")) -> None:
    """Where the hook is installed, and which naming level applies to the installed PyTorch."""
    from comminsight_inject import installer
    from comminsight_inject.__main__ import describe_status

    try:
        facts = installer.status(python)
    except installer.InstallError as exc:
        _fail(exc)
        return
    typer.echo(json.dumps(facts, indent=1) if as_json else describe_status(facts))


@app.command("uninstall")
def uninstall_command(python: str | None = PYTHON) -> None:
    """Remove exactly what install put there."""
    from comminsight_inject import installer

    try:
        target, removed = installer.uninstall(python)
    except installer.InstallError as exc:
        _fail(exc)
        return
    if not removed:
        typer.echo(f"nothing to remove: not installed in {target.site_dir}")
    for path in removed:
        typer.echo(f"removed {path}")
