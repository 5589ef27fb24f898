"""End to end with the real profiler plugin driven by the simulator (one process per rank) and the agent.

The simulator writes a ground truth next to its output; the archives the agent produced must hold
every recorded operation of every rank exactly once — across an agent SIGKILL and restart, a crashed
rank, and an agent started after the job — and the hang scenario must be named on the live API.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from agentkit import COMMINSIGHT, wait_for

from comminsight.agent.segments import parse_header, records_from_bytes
from comminsight.formats import header
from comminsight.formats.archive import read_archive

PLUGIN = Path(__file__).resolve().parents[2] / "native/profiler/build/libnccl-profiler-comminsight.so"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PLUGIN.exists(), reason="profiler plugin not built (make -C native/profiler)"),
]
C = header.constants()


def simulate(home: Path, *args: str, background: bool = False) -> subprocess.Popen | subprocess.CompletedProcess:
    argv = [
        str(COMMINSIGHT),
        "simulate",
        "run",
        "--home",
        str(home),
        "--plugin",
        str(PLUGIN),
        "-q",
        "--step-ms",
        "20",
        *args,
    ]
    if background:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def archived_ops(root: Path) -> Counter:
    """(global rank, comm hash, func, seq) of every terminal record in every archive (snapshots excluded)."""
    ops: Counter = Counter()
    for path in sorted(root.rglob("*.tar.zst")):
        for name, data in read_archive(path)[1]:
            if not name.startswith("segments/"):
                continue
            hdr = parse_header(data, Path(name))
            records, _, _ = records_from_bytes(memoryview(data)[C["CI_LOG_HEADER_SIZE"] :])
            records = records[records["state"] != C["CI_STATE_TIMEOUT"]]
            funcs = [bytes(f).split(b"\0")[0].decode() for f in records["func"]]
            for comm, func, seq in zip(records["comm_hash"].tolist(), funcs, records["seq"].tolist(), strict=True):
                ops[(hdr.global_rank, f"0x{comm:016x}", func, seq)] += 1
    return ops


def truth_ops(home: Path, ranks: set[int] | None = None) -> Counter:
    ops = json.loads((home / "ground_truth.json").read_text())["operations"]
    keys = zip(ops["rank"], ops["comm_hash"], ops["func"], ops["seq"], ops["recorded"], strict=True)
    return Counter((r, c, f, s) for r, c, f, s, rec in keys if rec and (ranks is None or r in ranks))


def sim_env(home: Path, **extra: str) -> dict[str, str]:
    return {"COMMINSIGHT_AGENT_ORPHAN_GRACE": "0.5", **extra}


def test_simulated_job_archives_every_operation_exactly_once_across_agent_sigkill(home: Path, start_agent) -> None:
    agent = start_agent()
    job = simulate(
        home,
        "-n",
        "4",
        "--steps",
        "100",
        "--layout",
        "ddp",
        "-e",
        "COMMINSIGHT_LOG_SEGMENT_BYTES=65536",
        background=True,
    )
    wait_for(lambda: len(list((home / "shms").glob("*.ring"))) == 4, timeout=30, interval=0.02)
    time.sleep(0.7)
    assert job.poll() is None, "the job should still be running when the agent is killed"
    agent.kill()  # mid-run, possibly mid-seal
    agent = start_agent()
    assert job.wait(120) == 0, job.stdout.read()
    wait_for(lambda: not list((home / "inspector_logs").glob("*")), timeout=30)
    assert agent.stop() == 0
    got = archived_ops(home.parent / "mount")
    expected = truth_ops(home)
    assert max(got.values()) == 1, "an operation was archived twice"
    assert got == expected


def test_simulated_crash_keeps_every_operation_the_crashed_rank_recorded(home: Path, start_agent) -> None:
    agent = start_agent()
    result = simulate(home, "-n", "4", "--steps", "6", "-s", "crash", "-r", "1", "--step", "2", "--hang-timeout", "3")
    assert (home / "ground_truth.json").exists(), result.stdout + result.stderr
    wait_for(lambda: not list((home / "inspector_logs").glob("*")), timeout=30)
    assert agent.stop() == 0
    got = archived_ops(home.parent / "mount")
    assert max(got.values()) == 1
    expected = truth_ops(home)
    assert set(got) == set(expected)


def test_agent_started_after_the_simulated_job_gets_everything(home: Path, start_agent) -> None:
    result = simulate(home, "-n", "4", "--steps", "5", "--layout", "fsdp")
    assert result.returncode == 0, result.stdout + result.stderr
    agent = start_agent()
    wait_for(lambda: not list((home / "inspector_logs").glob("*")), timeout=30)
    assert agent.stop() == 0
    got = archived_ops(home.parent / "mount")
    assert got == truth_ops(home)


def test_simulated_hang_is_named_on_the_live_api(home: Path, start_agent) -> None:
    poll = 0.05
    agent = start_agent(COMMINSIGHT_AGENT_HANG_FLOOR="1.0", COMMINSIGHT_ARCHIVE_INTERVAL="30")
    job = simulate(
        home,
        "-n",
        "4",
        "--steps",
        "4",
        "-s",
        "hang",
        "-r",
        "2",
        "--step",
        "2",
        "--op-index",
        "1",
        "--hang-timeout",
        "8",
        "-e",
        "COMMINSIGHT_HANG_TIMEOUT_S=1",
        background=True,
    )
    try:
        first_inflight = wait_for(lambda: agent.get("/api/v1/inflight").json()["inflight"], timeout=30)
        threshold = first_inflight[0]["threshold_s"]

        def named():
            hang = agent.get("/api/v1/hang").json()
            earliest = [s for s in hang["suspicions"] if s["earliest_on_communicator"]]
            return earliest and earliest[0]["never_entered"] == [2] and earliest[0]

        # When it is raised is tested on a simulated clock (test_state.py); here: that it is, and what it names.
        suspicion = wait_for(named, timeout=threshold + 60, interval=poll)
        truth_blocked = None
        job.wait(60)
        truth = json.loads((home / "ground_truth.json").read_text())
        truth_blocked = truth["faults"][0]["blocked_ops"][0]
        assert suspicion["comm_hash"] == truth_blocked["comm_hash"]
        assert suspicion["op"] == truth_blocked["func"]
        assert suspicion["seq"] == truth_blocked["seq"]
        assert sorted(e["rank"] for e in suspicion["entered"]) == truth_blocked["waiting_ranks"]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


MEGATRON_DESCS = {"default_pg", "TENSOR_MODEL_PARALLEL_GROUP", "PIPELINE_MODEL_PARALLEL_GROUP", "DATA_PARALLEL_GROUP"}


def test_communicators_without_a_comm_name_get_their_process_group_names_on_the_api_and_in_archives(
    home: Path, start_agent
) -> None:
    # PyTorch 2.11 gives NCCL no commName: the simulated ranks write the hook's tables instead
    result = simulate(
        home, "-n", "4", "--steps", "3", "--layout", "megatron", "--tp", "2", "--pp", "2", "--no-comm-names"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    agent = start_agent()
    truth = {c["comm_hash"]: c for c in json.loads((home / "ground_truth.json").read_text())["communicators"]}

    def all_named():
        answer = agent.get("/api/v1/communicators").json()
        return answer["communicators"] and all(c["group_desc"] for c in answer["communicators"]) and answer

    answer = wait_for(all_named, timeout=120)
    assert {c["group_desc"] for c in answer["communicators"]} <= MEGATRON_DESCS
    assert {c["group_desc"] for c in answer["communicators"]} >= {"TENSOR_MODEL_PARALLEL_GROUP"}
    for c in answer["communicators"]:
        assert sorted(c["group_ranks"]) == sorted(truth[c["comm_hash"]]["ranks"])
        assert c["comm_name"] == f"{c['group_desc']}:{c['group_name']}"
    assert answer["names"]["named"] == answer["names"]["communicators"] == len(answer["communicators"])
    wait_for(lambda: not list((home / "inspector_logs").glob("*")), timeout=120)
    assert agent.stop() == 0
    archived = [name for path in (home.parent / "mount").rglob("*.tar.zst") for name, _ in read_archive(path)[1]]
    assert sum(name.startswith("metadata/process_groups-") for name in archived) >= 4  # one table per rank


def live_step_summaries(home: Path) -> list[tuple]:
    rows = []
    for path in sorted((home / "semantics" / "step").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            s = json.loads(line)
            rows.append((s["rank"], s["step"], s["start_ns"], s["end_ns"], s["ops"], s["bytes"]))
    return sorted(rows)


def replayed_step_summaries(mount: Path, tmp: Path) -> list[tuple]:
    """The same records fed once, in order, to a fresh live step engine: one uninterrupted run."""
    from comminsight.agent.steps import LiveSteps

    per_pid: dict[int, list] = {}
    ranks: dict[int, int] = {}
    for path in sorted(mount.rglob("*.tar.zst")):
        for name, data in read_archive(path)[1]:
            if name.startswith("segments/"):
                hdr = parse_header(data, Path(name))
                records, _, _ = records_from_bytes(memoryview(data)[C["CI_LOG_HEADER_SIZE"] :])
                per_pid.setdefault(hdr.pid, []).append(records)
                ranks[hdr.pid] = hdr.global_rank
    steps = LiveSteps(tmp, "replay", lambda: ranks)
    for pid, parts in per_pid.items():
        records = np.concatenate(parts)
        records = records[np.argsort(records["record_seq"], kind="stable")]
        steps.feed(str(pid), records)
    steps.flush()
    rows = []
    for path in sorted(tmp.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            s = json.loads(line)
            rows.append((s["rank"], s["step"], s["start_ns"], s["end_ns"], s["ops"], s["bytes"]))
    return sorted(rows)


def test_live_steps_continue_across_an_agent_sigkill_without_gap_or_duplicate(home: Path, start_agent, tmp_path):
    agent = start_agent(COMMINSIGHT_ARCHIVE_INTERVAL="1", COMMINSIGHT_AGENT_SAMPLE_INTERVAL="0")
    job = simulate(home, "-n", "2", "--steps", "400", "--layout", "ddp", "--step-ms", "10", background=True)
    # Steps become final after the engine's warm-up (512 operations per GPU), well inside the run.
    wait_for(lambda: live_step_summaries(home), timeout=90, interval=0.1)
    assert job.poll() is None, "the job should still be running when the agent is killed"
    before = len(live_step_summaries(home))
    agent.kill()
    agent = start_agent(COMMINSIGHT_ARCHIVE_INTERVAL="1", COMMINSIGHT_AGENT_SAMPLE_INTERVAL="0")
    assert job.wait(180) == 0, job.stdout.read()
    wait_for(lambda: not list((home / "inspector_logs").glob("*")), timeout=30)
    steps_view = agent.get("/api/v1/steps").json()
    assert agent.stop() == 0
    live = live_step_summaries(home)
    assert len(live) > before
    for rank in (0, 1):
        ids = [step for r, step, *_ in live if r == rank]
        assert ids == list(range(len(ids))), f"rank {rank}: steps missing or repeated"
    assert live == replayed_step_summaries(home.parent / "mount", tmp_path / "replay")
    assert {r["rank"] for r in steps_view["ranks"]} == {0, 1}
    archived = [name for path in (home.parent / "mount").rglob("*.tar.zst") for name, _ in read_archive(path)[1]]
    assert any(name.startswith("steps/") for name in archived)


def test_a_running_jobs_archive_is_sealed_on_request_within_an_archive_interval(home: Path, start_agent) -> None:
    agent = start_agent(COMMINSIGHT_ARCHIVE_INTERVAL="1", COMMINSIGHT_AGENT_SAMPLE_INTERVAL="0")
    # The profiler's own segment age stays at its 300 s default: without a seal request nothing is closed.
    job = simulate(home, "-n", "2", "--steps", "400", "--step-ms", "20", background=True)
    wait_for(lambda: list((home.parent / "mount").rglob("*.tar.zst")), timeout=60, interval=0.1)
    running = job.poll() is None
    assert job.wait(180) == 0
    assert agent.stop() == 0
    assert running, "an archive should exist while the job still runs"
