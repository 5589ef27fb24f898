"""Time to diagnosis: how long after progress stops does the agent report a hang, and name its root cause?

Each scenario runs a simulated job (``comminsight simulate``, the real profiler plugin in one process
per rank) next to a real agent with its default hang settings, and polls the agent's
``/api/v1/hang`` every 0.1 s. The stall moment is the faulty rank's own journal line (``hung`` /
``crash``, written by the simulator when it stops); the profiler keeps its default global
``hang_timeout_s`` (300 s), so everything seen earlier comes from the agent's adaptive thresholds.

Prints, per scenario: detection latency (first ``"hang": true``), root-cause latency (first
``root_cause_ranks``), the ranks named and the ranks expected; and for the pause scenario (every rank
pauses 90 s outside communication) whether any hang was reported at all (a false alarm).
Targets (Mycroft's): detection <= 15 s, root cause <= 20 s. Baseline named in the output: the
previous agent defaults (floor 30 s, profiler snapshots at its own timeout) reported 47 s after the
stall on the 8-rank Megatron case.

    .venv/bin/python bench/live_diagnosis.py [--only NAME] [--pause-s 90]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "native/profiler/build/libnccl-profiler-comminsight.so"
BIN = Path(sys.executable).parent / "comminsight"

SCENARIOS = {
    # name: (simulate arguments, expected root-cause ranks)
    "hang-outside-collective (ddp, 4 ranks, rank 2)": (
        ["--layout", "ddp", "-n", "4", "-s", "hang", "-r", "2", "--step", "20", "--op-index", "1"],
        [2],
    ),
    "hang-in-collective (megatron 8 ranks tp2 pp2 dp2, rank 5)": (
        ["--layout", "megatron", "--tp", "2", "--pp", "2", "--dp", "2", "-s", "hang", "-r", "5", "--step", "8"],
        [5],
    ),
    "crash (ddp, 4 ranks, rank 1)": (
        ["--layout", "ddp", "-n", "4", "-s", "crash", "-r", "1", "--step", "20", "--op-index", "2"],
        [1],
    ),
    "p2p-stall (megatron pp4, rank 2 stops before a pipeline send/recv)": (
        ["--layout", "megatron", "--tp", "1", "--pp", "4", "--dp", "1", "-s", "hang", "-r", "2", "--step", "8"],
        [2],
    ),
}


def start_agent(home: Path) -> tuple[subprocess.Popen, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMINSIGHT_")}
    env.update(
        COMMINSIGHT_HOME=str(home),
        COMMINSIGHT_AGENT_LISTEN="127.0.0.1:0",
        COMMINSIGHT_WORKLOAD_ID="bench",
        COMMINSIGHT_AGENT_SAMPLE_INTERVAL="0",
    )
    log = open(home.parent / "agent.log", "w")  # noqa: SIM115 - lives as long as the agent
    proc = subprocess.Popen([str(BIN), "agent", "run"], env=env, stdout=log, stderr=subprocess.STDOUT)
    marker = home / "metadata/agent/agent.json"
    for _ in range(300):
        if marker.exists():
            info = json.loads(marker.read_text() or "{}")
            if info.get("pid") == proc.pid and info.get("listen"):
                return proc, f"http://{info['listen']}"
        time.sleep(0.1)
    raise RuntimeError("agent did not start")


def stall_ns(home: Path) -> int | None:
    for journal in (home / "simulator").glob("rank-*.jsonl"):
        for line in journal.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("ev") in ("hung", "crash"):
                return int(event["t"])
    return None


def run(name: str, args: list[str], expected: list[int] | None, watch_s: float, pause_s: float) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="ci-bench-live-"))
    home = tmp / "home"
    (home / "metadata/agent").mkdir(parents=True)
    agent, url = start_agent(home)
    steps = ["--steps", "40", "--step-ms", "50"]
    sim = subprocess.Popen(
        [
            str(BIN),
            "simulate",
            "run",
            "-o",
            str(home),
            "--plugin",
            str(PLUGIN),
            "-q",
            "--reuse-home",
            *steps,
            *args,
            "--hang-timeout",
            str(watch_s),
            "--on-hang",
            "kill",
            "-e",
            "COMMINSIGHT_HANG_TIMEOUT_S=300",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    stall = None
    detected = rooted = None
    named: list[int] = []
    first_stuck = None
    false_alarm = False
    deadline = time.monotonic() + watch_s + 60
    try:
        while time.monotonic() < deadline and sim.poll() is None:
            stall = stall or stall_ns(home)
            try:
                hang = httpx.get(f"{url}/api/v1/hang", timeout=2).json()
            except httpx.HTTPError:
                hang = {}
            now = time.time_ns()
            if hang.get("hang"):
                false_alarm = expected is None
                detected = detected or now
                if hang.get("root_cause_ranks") and rooted is None:
                    rooted, named, first_stuck = now, hang["root_cause_ranks"], hang.get("first_stuck")
            if stall and (rooted or now - stall > watch_s * 1e9):
                break
            time.sleep(0.1)
    finally:
        # The simulator ends the stalled run itself (SIGKILL of its ranks after --hang-timeout).
        try:
            sim.wait(watch_s + 60)
        except subprocess.TimeoutExpired:
            sim.send_signal(signal.SIGINT)
            sim.wait(30)
        agent.send_signal(signal.SIGTERM)
        agent.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "scenario": name,
        "detect_s": None if not (detected and stall) else round((detected - stall) / 1e9, 2),
        "root_cause_s": None if not (rooted and stall) else round((rooted - stall) / 1e9, 2),
        "named": named,
        "expected": expected,
        "first_stuck": first_stuck,
        "false_alarm": false_alarm if expected is None else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="run the scenarios whose name contains this")
    parser.add_argument("--pause-s", type=float, default=90.0)
    parser.add_argument("--watch-s", type=float, default=30.0, help="give up this long after the stall")
    opts = parser.parse_args()
    if not PLUGIN.exists():
        sys.exit("build the profiler first: make -C native/profiler")
    results = []
    runs = dict(SCENARIOS)
    runs[f"false-alarm: every rank pauses {opts.pause_s:.0f} s outside communication"] = (
        ["--layout", "ddp", "-n", "4", "-s", "pause", "--step", "20", "--pause-s", str(opts.pause_s)],
        None,
    )
    for name, (args, expected) in runs.items():
        if opts.only and opts.only not in name:
            continue
        if expected is None:
            result = run_pause(name, args, opts.pause_s)
        else:
            result = run(name, args, expected, opts.watch_s, opts.pause_s)
        results.append(result)
        print(json.dumps(result), flush=True)
    print("\nscenario | detect (s) | root cause (s) | named | expected")
    for r in results:
        if r["expected"] is None:
            print(f"{r['scenario']} | false alarm: {'YES' if r['false_alarm'] else 'no'}")
        else:
            print(f"{r['scenario']} | {r['detect_s']} | {r['root_cause_s']} | {r['named']} | {r['expected']}")
    print("targets: detect <= 15 s, root cause <= 20 s; baseline (previous defaults): 47 s, no root cause")


def run_pause(name: str, args: list[str], pause_s: float) -> dict:
    """The job pauses on every rank for pause_s outside communication: any hang report is a false alarm."""
    tmp = Path(tempfile.mkdtemp(prefix="ci-bench-live-"))
    home = tmp / "home"
    (home / "metadata/agent").mkdir(parents=True)
    agent, url = start_agent(home)
    sim = subprocess.Popen(
        [
            str(BIN),
            "simulate",
            "run",
            "-o",
            str(home),
            "--plugin",
            str(PLUGIN),
            "-q",
            "--reuse-home",
            "--steps",
            "40",
            "--step-ms",
            "50",
            *args,
            "-e",
            "COMMINSIGHT_HANG_TIMEOUT_S=300",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    alarms = 0
    polls = 0
    try:
        while sim.poll() is None:
            try:
                alarms += bool(httpx.get(f"{url}/api/v1/hang", timeout=2).json().get("hang"))
                polls += 1
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "scenario": name,
        "expected": None,
        "false_alarm": alarms > 0,
        "polls": polls,
        "job_exit": sim.returncode,
    }


if __name__ == "__main__":
    main()
