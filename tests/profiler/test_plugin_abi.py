"""The plugin driven through its NCCL ABI (cffi), one process per scenario: what NCCL and users would see."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pytest

from comminsight.formats import rawlog

NOT_NEEDED_V5 = ["Group", "GroupApi", "KernelLaunch", "NetPlugin", "ProxyCtrl", "ProxyStep"]


def records(home: Path):
    return rawlog.read_logs(home / "inspector_logs")


def the_ring(home: Path) -> rawlog.Segment:
    (ring,) = (home / "shms").glob("*.ring")
    return rawlog.read_ring(ring)


def test_library_exports_only_the_v5_and_v4_tables(library):
    out = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True, check=True)
    symbols = sorted(line.split()[-1] for line in out.stdout.splitlines() if line.strip())
    assert symbols == ["ncclProfiler_v4", "ncclProfiler_v5"]


def test_every_v5_event_type_gets_a_handle_only_when_needed(drive, home):
    result, _ = drive("every-type", "--abi", "5")
    assert result["null_handles"] == NOT_NEEDED_V5
    table = records(home)
    assert sorted(table["func"].to_pylist()) == ["AllReduce", "Send"]
    assert set(table["state"].to_pylist()) == {1}


def test_every_v4_event_type_is_handled_by_the_v4_shim(drive, home):
    result, _ = drive("every-type", "--abi", "4")
    assert result["null_handles"] == ["Group", "NetPlugin", "ProxyCtrl", "ProxyStep"]
    assert result["mask"] & (1 << 9) == 0  # no API events asked of NCCL 2.27
    assert records(home).num_rows == 2


def test_eight_thread_storm_reads_back_every_operation_exactly(drive, home):
    result, _ = drive("ops", "--threads", "8", "--ops", "1000")
    table = records(home)
    assert result["dropped"] == 0
    assert table.num_rows == 8000
    assert len(set(table["seq"].to_pylist())) == 8000
    assert pc.all(pc.equal(table["state"], 1)).as_py()
    assert pc.all(pc.greater(table["gpu_end_ns"], table["gpu_start_ns"])).as_py()
    assert set(table["n_channels"].to_pylist()) == {2}
    assert set(table["stream"].to_pylist()) == {0x7000}  # from the CollApi parent


def test_a_full_pool_drops_and_counts_instead_of_blocking(drive, home, env_for):
    result, _ = drive("ops", "--threads", "8", "--ops", "500", env=env_for(home, COMMINSIGHT_POOL_SIZE="64"))
    table = records(home)
    assert table.num_rows + result["dropped"] == 4000
    assert the_ring(home).extra["lost"] == result["dropped"]


def test_a_ring_nobody_consumes_drops_and_counts_while_raw_logs_keep_everything(drive, home, env_for):
    drive("ops", "--ops", "500", env=env_for(home, COMMINSIGHT_RING_CAPACITY="64"))
    ring = the_ring(home)
    assert ring.extra["head"] == 64
    assert ring.extra["dropped"] == 436
    assert ring.table.num_rows == 64
    assert records(home).num_rows == 500


def test_a_null_comm_name_is_recorded_as_empty(drive, home):
    drive("ops", "--ops", "5", "--null-name")
    assert set(records(home)["comm_name"].to_pylist()) == {""}


def test_comm_metadata_comes_from_init(drive, home):
    drive("ops", "--ops", "3", "--name", "tp:group-7", "--comm-hash", "0xfeedface", "--nranks", "16", "--rank", "5")
    table = records(home)
    assert set(table["comm_name"].to_pylist()) == {"tp:group-7"}
    assert set(table["comm_hash"].to_pylist()) == {0xFEEDFACE}
    assert set(table["rank"].to_pylist()) == {5}
    assert set(table["nranks"].to_pylist()) == {16}
    assert set(table["bytes"].to_pylist()) == {4096}  # 1024 x ncclFloat32


@pytest.mark.slow
def test_unload_and_reload_in_one_process_restart_the_writer(drive, home):
    result, _ = drive("reload", "--cycles", "3", "--ops", "50")
    assert [c["dropped"] for c in result["cycles"]] == [0, 0, 0]
    sealed = sorted((home / "inspector_logs").glob("*.cilog.sealed"))
    assert len(sealed) == 3
    assert records(home).num_rows == 150


@pytest.mark.slow
def test_a_process_killed_mid_run_leaves_logs_readable_up_to_the_last_complete_record(
    driver_path, library, home, env_for
):
    proc = subprocess.Popen(
        [sys.executable, str(driver_path), str(library), "hold", "--nranks", "2"],
        env=env_for(home),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        for line in proc.stdout:
            if json.loads(line)["completed"] >= 3000:
                break
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    (segment,) = (home / "inspector_logs").glob("*.cilog")  # never sealed: no finalize ran
    read = rawlog.read_segment(segment)
    seqs = np.sort(read.table["seq"].to_numpy())
    assert read.invalid_records == 0
    assert len(seqs) > 0
    assert np.array_equal(seqs, np.arange(len(seqs)))  # a prefix, no hole
    # a crash in the middle of a write leaves a torn tail: it is skipped, not fatal
    with segment.open("ab") as f:
        f.write(b"\x43\x49\x52\x43" + b"\x00" * 100)
    torn = rawlog.read_segment(segment)
    assert torn.table.num_rows == len(seqs)
    assert torn.torn_bytes == 104


def test_operations_in_flight_at_finalize_become_records_and_evidence(drive, home):
    drive("ops", "--ops", "4", "--leave-open", "2", "--name", 'odd "name" \\ here')
    table = records(home)
    states = table["state"].to_pylist()
    assert states.count(1) == 4
    assert states.count(2) == 2  # enqueued: no kernel channel ever started
    (evidence,) = (home / "hang_detection").glob("*-finalize-*.json")
    report = json.loads(evidence.read_text())
    assert report["reason"] == "finalize"
    assert [op["state"] for op in report["operations"]] == ["enqueued", "enqueued"]
    assert report["operations"][0]["comm_name"] == 'odd "name" \\ here'


def test_segments_rotate_by_size_and_lose_nothing(drive, home, env_for):
    drive("ops", "--ops", "2000", "--nch", "1", env=env_for(home, COMMINSIGHT_LOG_SEGMENT_BYTES="65536"))
    sealed = list((home / "inspector_logs").glob("*.cilog.sealed"))
    assert len(sealed) >= 7
    assert records(home).num_rows == 2000


def test_bad_configuration_values_warn_once_each_and_fall_back_to_defaults(drive, home, env_for):
    (home / "etc").mkdir()
    (home / "etc/comminsight.conf").write_text(
        "# comment\n"
        "hang_timeout_s = -5\n"
        "log_segment_bytes = 12abc\n"
        "a line without equals\n"
        "mystery_key = 1\n"
        "agent_server_url = http://site.example\n"
        "writer_interval_ms = 3\n"
    )
    env = env_for(home, COMMINSIGHT_POOL_SIZE="banana", COMMINSIGHT_RING_CAPACITY="1000", COMMINSIGHT_CLOCK="sundial")
    _, stderr = drive("ops", "--ops", "20", env=env)
    warnings = [line for line in stderr.splitlines() if "comminsight: warning" in line]
    for key in ("pool_size", "ring_capacity", "hang_timeout_s", "log_segment_bytes", "clock", "mystery_key"):
        assert sum(key in w for w in warnings) == 1, (key, warnings)
    assert sum("without equals" in w or "expected 'key = value'" in w for w in warnings) == 1
    assert not any("agent_server_url" in w for w in warnings)
    assert records(home).num_rows == 20
    assert the_ring(home).header["capacity"] == 16384  # the default


def test_environment_beats_the_conf_file(drive, home, env_for):
    (home / "etc").mkdir()
    (home / "etc/comminsight.conf").write_text("ring_capacity = 128\n")
    drive("ops", "--ops", "1", env=env_for(home, COMMINSIGHT_RING_CAPACITY="256"))
    assert the_ring(home).header["capacity"] == 256


def test_the_conf_file_alone_beats_the_defaults(drive, home):
    (home / "etc").mkdir()
    (home / "etc/comminsight.conf").write_text("ring_capacity = 128\n")
    drive("ops", "--ops", "1")
    assert the_ring(home).header["capacity"] == 128


def test_an_oversized_conf_file_is_cut_with_a_warning(drive, home):
    (home / "etc").mkdir()
    (home / "etc/comminsight.conf").write_text(("#" * 200 + "\n") * 600 + "ring_capacity = 128\n")
    _, stderr = drive("ops", "--ops", "1")
    assert "larger than" in stderr
    assert the_ring(home).header["capacity"] == 16384


def test_an_unusable_home_degrades_with_warnings_and_keeps_going(drive, tmp_path, env_for):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    result, stderr = drive("ops", "--ops", "50", env=env_for(not_a_dir))
    assert result["ops"] == 50
    assert "cannot create" in stderr


def test_agent_autostart_with_a_missing_binary_is_only_a_warning(drive, home, env_for):
    env = env_for(home, COMMINSIGHT_AGENT_AUTOSTART="1", LOCAL_RANK="0")
    _, stderr = drive("ops", "--ops", "2", env=env)
    assert "comminsight-agent not found" in stderr
    assert records(home).num_rows == 2


@pytest.mark.slow
def test_agent_autostart_starts_one_detached_agent_holding_the_lock(drive, home, tmp_path, env_for):
    marker = tmp_path / "agent-started"
    (home / "bin").mkdir()
    agent = home / "bin/comminsight-agent"
    # a stand-in agent: records that it ran and its lock fd, then lives a little while
    agent.write_text(
        f'#!/bin/sh\necho "$COMMINSIGHT_AGENT_LOCK_FD $$ $COMMINSIGHT_LIFELINE_PID" >> {marker}\nsleep 3\n'
    )
    agent.chmod(0o755)
    env = env_for(home, COMMINSIGHT_AGENT_AUTOSTART="1", LOCAL_RANK="0")
    drive("ops", "--ops", "1", env=env)
    drive("ops", "--ops", "1", env=env)  # a second process: the lock is held, no second agent
    for _ in range(50):
        if marker.exists():
            break
        subprocess.run(["sleep", "0.1"], check=True)
    lines = marker.read_text().splitlines()
    assert len(lines) == 1
    lock_fd, agent_pid, lifeline_pid = lines[0].split()
    assert lock_fd.isdigit()
    # The agent's lifeline is the process that started it (it stops once that process has ended).
    assert lifeline_pid.isdigit()
    assert lifeline_pid != agent_pid


def test_make_install_puts_the_library_under_the_prefix(library, tmp_path):
    repo = library.parents[3]
    subprocess.run(["make", "-s", "-C", str(repo / "native/profiler"), "install", f"PREFIX={tmp_path}"], check=True)
    assert (tmp_path / "lib" / library.name).is_file()


def test_the_cuda_device_is_taken_from_the_visible_list_and_the_local_rank(drive, home, env_for):
    env = env_for(home, CUDA_VISIBLE_DEVICES="3,5", LOCAL_RANK="1")
    drive("ops", "--ops", "1", env=env)
    assert set(records(home)["cuda_device"].to_pylist()) == {5}


def test_an_unknown_cuda_device_is_minus_one(drive, home):
    drive("ops", "--ops", "1")
    assert set(records(home)["cuda_device"].to_pylist()) == {-1}


def test_segment_headers_carry_the_job_identity(drive, home, env_for):
    env = env_for(home, RANK="9", WORLD_SIZE="16", LOCAL_RANK="1", COMMINSIGHT_WORKLOAD_ID="job-42", NODE_IP="10.0.0.7")
    drive("ops", "--ops", "1", env=env)
    (segment,) = (home / "inspector_logs").glob("*.cilog.sealed")
    header = rawlog.read_segment(segment).header
    assert (header["global_rank"], header["world_size"], header["local_rank"]) == (9, 16, 1)
    assert header["workload_id"] == "job-42"
    assert header["node_ip"] == "10.0.0.7"
