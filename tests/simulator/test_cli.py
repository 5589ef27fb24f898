"""``comminsight simulate`` as a user runs it, and the inputs the simulator reads (specs, journals)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from comminsight.cli import app
from comminsight.simulator.runner import _read_journal

runner = CliRunner()


@pytest.mark.slow
def test_simulate_run_writes_logs_and_says_where_the_ground_truth_is(plugin_so: Path, tmp_path: Path) -> None:
    home = tmp_path / "out"
    result = runner.invoke(
        app,
        ["simulate", "run", "--layout", "ddp", "--ranks", "2", "--steps", "2", "--step-ms", "10", "-o", str(home),
         "--plugin", str(plugin_so), "--scenario", "straggler", "--rank", "1", "--slow-pct", "50", "--from-step", "1"],
    )  # fmt: skip

    assert result.exit_code == 0, result.output
    truth_path = home / "ground_truth.json"
    assert str(truth_path) in result.output
    truth = json.loads(truth_path.read_text())
    assert truth["faults"][0] == {"rank": 1, "slow_pct": 50.0, "from_step": 1, "phase": "", "type": "straggler"}
    assert len(list((home / "inspector_logs").iterdir())) == 2

    again = runner.invoke(app, ["simulate", "run", "-o", str(home), "--plugin", str(plugin_so), "-n", "2"])
    assert again.exit_code == 2
    assert "already holds raw logs" in again.output
    assert len(list((home / "inspector_logs").iterdir())) == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--layout", "megatron", "--tp", "3", "--ranks", "4"], "does not equal"),
        (["--scenario", "hang", "--rank", "7"], "rank 7 is not in"),
        (["--scenario", "slow-link", "--link", "zero,one"], "two global ranks"),
        (["--env", "no-equals-sign"], "KEY=VALUE"),
        (["--env", "BAD KEY=1"], "KEY=VALUE"),
        (["--layout", "zero3"], "zero3"),
        (["--steps", "0"], "steps"),
        (["--scenario", "late", "--stage", "1"], "needs the megatron layout"),
        (["--scenario", "late", "--phase", "lunch"], "phase must be one of"),
    ],
)
def test_bad_options_fail_clearly_before_anything_starts(tmp_path: Path, args: list[str], message: str) -> None:
    home = tmp_path / "never"
    result = runner.invoke(app, ["simulate", "run", "-o", str(home), "--plugin", "/dev/null", *args])

    assert result.exit_code == 2
    assert message in result.output
    assert not home.exists()


def test_a_missing_plugin_is_reported_without_side_effects(tmp_path: Path) -> None:
    home = tmp_path / "never"
    result = runner.invoke(app, ["simulate", "run", "-o", str(home), "--plugin", str(tmp_path / "nope.so")])

    assert result.exit_code == 2
    assert f"profiler plugin {tmp_path / 'nope.so'} does not exist" in result.output
    assert not home.exists()


def test_plan_lists_communicators_and_launches_without_running_anything() -> None:
    result = runner.invoke(app, ["simulate", "plan", "--layout", "megatron", "--tp", "2", "--pp", "2", "--dp", "2"])

    assert result.exit_code == 0, result.output
    for name in ("world", "tp3", "pp0", "dp1", "mp1"):
        assert name in result.output


@pytest.mark.parametrize(
    "content",
    [b"", b"not json", b"[]", b'{"rank": 0}', json.dumps({"rank": 0, "plugin": "x", "home": "h", "board": "b",
                                                          "journal": "j", "config": {"ranks": "many"}}).encode()],
)  # fmt: skip
def test_a_rank_process_refuses_a_malformed_spec(tmp_path: Path, content: bytes) -> None:
    spec = tmp_path / "spec.json"
    spec.write_bytes(content)
    done = subprocess.run(
        [sys.executable, "-m", "comminsight.simulator.rank", str(spec)], capture_output=True, text=True, timeout=60
    )

    assert done.returncode == 2
    assert "invalid rank spec" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.json"]


def test_a_torn_last_journal_line_is_ignored(tmp_path: Path) -> None:
    journal = tmp_path / "rank-00000.jsonl"
    journal.write_bytes(b'{"ev":"start","rank":0}\n{"ev":"step_start","step":0,"t":5}\n{"ev":"enq","st')

    assert [e["ev"] for e in _read_journal(journal)] == ["start", "step_start"]
