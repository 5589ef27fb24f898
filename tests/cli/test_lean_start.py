"""A command loads the libraries it uses and no others: what a user pays for each run of ``comminsight``.

Each run is a fresh interpreter, so every module imported is paid for again: ``import comminsight.cli``
once loaded Arrow, polars, numpy, rich, the simulator and the agent's code for every command, and
pyarrow loaded pandas (about 0.25 s of CPU, half the analysis of a small trace) wherever it was
installed. These tests read the modules a real process ended with; they time nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import comminsight_inject

import comminsight

# Prints, at exit, the modules the process imported: at the interpreter's exit, or at the hard exit
# of a report command (os._exit skips atexit).
_REPORT = (
    "import atexit, json, os, sys\n"
    "def report(): sys.stderr.write('MODULES ' + json.dumps(sorted(sys.modules)) + '\\n'); sys.stderr.flush()\n"
    "atexit.register(report)\n"
    "hard_exit = os._exit\n"
    "os._exit = lambda code: (report(), hard_exit(code))\n"
)


def _run(
    code: str, tmp_path: Path, pandas: str = "raise RuntimeError('pandas was imported')\n"
) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    # A stand-in pandas (``pandas``: its code) that by default fails loudly when imported: the command must not
    # import it, even where pandas is installed (as it is beside HolisticTraceAnalysis).
    fake = tmp_path / "fake_site" / "pandas"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(pandas)
    path = [str(fake.parent), str(Path(comminsight.__file__).parents[1])]
    path.append(str(Path(comminsight_inject.__file__).parents[1]))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    done = subprocess.run(
        [sys.executable, "-c", _REPORT + code], capture_output=True, text=True, env=env, check=False, timeout=300
    )
    lines = [line for line in done.stderr.splitlines() if line.startswith("MODULES ")]
    assert lines, done.stderr[-2000:]
    return done, set(json.loads(lines[-1].removeprefix("MODULES ")))


def test_starting_the_command_line_loads_no_analysis_library(tmp_path: Path) -> None:
    _, modules = _run("import comminsight.cli", tmp_path)
    heavy = {"pyarrow", "polars", "numpy", "pandas", "rich", "httpx", "msgspec", "cffi", "zstandard"}
    assert heavy & modules == set()
    assert {m for m in modules if m.startswith(("comminsight.simulator", "comminsight.agent."))} == set()


def test_analyze_stragglers_on_kineto_traces_loads_only_what_it_uses(recorded_kineto, tmp_path: Path) -> None:
    traces, meta = recorded_kineto
    done, modules = _run(
        "import sys\n"
        "from comminsight.cli import main\n"
        f"sys.argv = ['comminsight', 'analyze', 'stragglers', {str(traces)!r}, '--format', 'json']\n"
        "main()\n",
        tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["culprits"] == [meta["ground_truth"]["slow_rank"]]
    # What the analysis needs...
    assert {"pyarrow", "polars", "numpy", "msgspec", "comminsight.importers.kineto"} <= modules
    # ... and nothing else: no pandas, no terminal rendering for JSON output, no HTTP client, no other
    # command's code, no importer tried after the one that recognised the traces, no step recovery
    # for traces that label their steps, no pyarrow.compute (its import wraps every compute function:
    # the importers call theirs through comminsight.evidence.compute).
    unused = {
        "pandas",
        "pyarrow.compute",
        "rich",
        "httpx",
        "pyarrow.parquet",
        "zstandard",
        "cffi",
        "comminsight.analysis.hang",
        "comminsight.formats.operations",
        "comminsight.importers.nccl_inspector",
        "comminsight.importers.table",
        "comminsight.semantic.steps",
        "comminsight.semantic.engine",
    }
    assert unused & modules == set()
    assert {m for m in modules if m.startswith(("comminsight.simulator", "comminsight.agent."))} == set()


def test_a_report_command_ends_with_its_own_exit_status_and_error_line(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-traces"
    done, _ = _run(
        "import sys\n"
        "from comminsight.cli import main\n"
        f"sys.argv = ['comminsight', 'analyze', 'stragglers', {str(missing)!r}, '--format', 'json']\n"
        "main()\n",
        tmp_path,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {missing}: no such file or directory"]


def test_commands_other_than_analyze_leave_pandas_importable(tmp_path: Path) -> None:
    # Only the analyze commands run without pandas (their fast start): another command may run code of the user's
    # that imports it (here, after the command returns, in the same process).
    done, modules = _run(
        "import sys\n"
        "from comminsight.cli import main\n"
        "sys.argv = ['comminsight', 'logs', '--help']\n"
        "try:\n"
        "    main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "import pandas\n",
        tmp_path,
        pandas="",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "pandas" in modules
