"""Every error of the ``comminsight`` command line is one line on stderr, whatever the terminal width.

A message that names a long path must still be one line a script can read (``error: <message>``), so
errors are written as plain text, never through rich (which wraps to the terminal and boxes Typer's
usage errors). :func:`fail` ends a command with an error; :class:`OneLineErrors` is the command group
class of the app, which writes Click's usage errors (unknown option, bad value, missing argument) the
same way, with the exit status Click gives them (2).
"""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

import click
import typer
from typer.core import TyperGroup


def one_line(message: object) -> str:
    """``message`` with every run of whitespace (newlines included) turned into one space."""
    return " ".join(str(message).split())


def write_error(message: object) -> None:
    """``error: <message>`` on stderr, one line (red only on a terminal, and never with NO_COLOR)."""
    prefix = "error:"
    if sys.stderr.isatty() and not os.environ.get("NO_COLOR"):
        prefix = "\x1b[31merror:\x1b[0m"
    sys.stderr.write(f"{prefix} {one_line(message)}\n")
    sys.stderr.flush()


def fail(message: object, code: int = 2) -> NoReturn:
    """End the command: write ``message`` as one error line and exit with ``code`` (2: bad input)."""
    write_error(message)
    raise typer.Exit(code)


def _usage_message(error: click.ClickException) -> str:
    message = error.format_message()
    context = getattr(error, "ctx", None)
    if isinstance(error, click.UsageError) and context is not None:
        message += f" (see '{context.command_path} --help')"
    return message


class OneLineErrors(TyperGroup):
    """Typer's group, with Click's errors written by :func:`write_error` instead of a rich panel."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        try:
            result = super().main(*args, standalone_mode=False, **kwargs)
        except click.exceptions.NoArgsIsHelpError as error:  # no arguments: the help, as Click shows it
            if not standalone_mode:
                raise
            click.echo(error.ctx.get_help(), err=False)
            sys.exit(error.exit_code)
        except click.ClickException as error:
            if not standalone_mode:
                raise
            write_error(_usage_message(error))
            sys.exit(error.exit_code)
        except click.exceptions.Abort:
            if not standalone_mode:
                raise
            write_error("aborted")
            sys.exit(1)
        if not standalone_mode:
            return result
        sys.exit(result if isinstance(result, int) else 0)
