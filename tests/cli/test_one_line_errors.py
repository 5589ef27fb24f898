"""Every error of the ``comminsight`` command line is one line on stderr, whatever the terminal width.

Asserted by parsing stderr (one ``error:`` line holding the whole message, nothing else), never by
comparing wrapped text, with a 20-column terminal and paths far longer than that.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click
import pytest
import typer
from typer.testing import CliRunner

from comminsight.cli import app

NARROW = {"COLUMNS": "20", "LINES": "10", "TERM": "xterm-256color"}
runner = CliRunner(env=NARROW)


def leaf_commands(command: click.Command, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(command, click.Group):
        return [leaf for name, sub in command.commands.items() for leaf in leaf_commands(sub, (*path, name))]
    return [path]


COMMANDS = leaf_commands(typer.main.get_command(app))


def the_error_line(stderr: str) -> str:
    """The one line stderr holds; fails when there are more (a wrapped message) or it is not an error."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one error line, got {len(lines)}: {lines}"
    assert lines[0].startswith("error: ")
    return lines[0]


def long_path(tmp_path: Path) -> Path:
    deep = tmp_path.joinpath(*["a-directory-name-much-longer-than-the-terminal-is-wide"] * 4)
    deep.mkdir(parents=True, exist_ok=True)
    return deep / "evidence-that-is-not-there.json"


def test_every_command_is_checked():
    assert len(COMMANDS) >= 15
    assert ("analyze", "hang") in COMMANDS
    assert ("import",) in COMMANDS


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_an_unknown_option_is_one_line_naming_the_option_and_the_help(command):
    result = runner.invoke(app, [*command, "--no-such-option-anywhere"])
    assert result.exit_code == 2
    line = the_error_line(result.stderr)
    assert "--no-such-option-anywhere" in line
    assert f"comminsight {' '.join(command)} --help" in line


def runtime_errors(missing: str, tmp_path: Path) -> list[tuple[list[str], int, str]]:
    """(arguments, exit status, what the one line must hold) for errors of every kind."""
    return [
        (["import", missing, "-o", str(tmp_path / "out.parquet")], 2, missing),
        (["analyze", "hang", missing], 2, missing),
        (["analyze", "steps", missing], 2, missing),
        (["analyze", "stragglers", missing], 2, missing),
        (["analyze", "perf", missing], 2, missing),
        (["analyze", "steps", missing, "--calibrate", "x"], 2, "--calibrate takes K:N"),
        (["export", "perfetto", missing, "-o", str(tmp_path / "trace.json")], 2, missing),
        (["logs", "show", missing], 2, missing),
        (["inject", "install", "--python", missing], 2, missing),
        (["inject", "status", "--python", missing], 2, missing),
        (["simulate", "run", "-o", str(tmp_path / "home"), "--plugin", missing], 2, missing),
        (["simulate", "run", "-o", missing, "--ranks", "0"], 2, "0 is not in the range"),
        (["simulate", "plan", "--layout", "megatron", "--tp", "3", "--ranks", "4"], 2, "Invalid value"),
        (["agent", "status", "--url", "http://127.0.0.1:9"], 1, "no agent answering at http://127.0.0.1:9"),
        (["analyze", "hang"], 2, "Missing argument 'PATH'"),
    ]


def test_runtime_and_usage_errors_of_every_kind_are_one_line_with_the_whole_message(tmp_path):
    missing = str(long_path(tmp_path))
    for args, code, expected in runtime_errors(missing, tmp_path):
        result = runner.invoke(app, args)
        assert result.exit_code == code, (args, result.stderr)
        assert expected in the_error_line(result.stderr), args


def test_the_installed_command_writes_its_errors_on_one_line_in_a_narrow_terminal(tmp_path):
    missing = str(long_path(tmp_path))
    comminsight = Path(sys.executable).parent / "comminsight"
    for args in (["analyze", "hang", missing], ["import", "--bogus"]):
        done = subprocess.run(
            [str(comminsight), *args], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", **NARROW}
        )
        assert done.returncode == 2
        line = the_error_line(done.stderr)
        assert missing in line or "--bogus" in line
