"""Communicator names end to end without GPUs: simulated ranks write the hook's tables, and every place
that shows a communicator (hang analysis on a home or an archive, the Perfetto export) names it."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from comminsight.agent.archiver import Archiver
from comminsight.agent.spool import Spool
from comminsight.evidence.process_groups import Observation, name_communicators, naming_summary
from comminsight.formats.archive import read_archive

COMMINSIGHT = Path(sys.executable).parent / "comminsight"
PLUGIN = Path(__file__).resolve().parents[2] / "native/profiler/build/libnccl-profiler-comminsight.so"
needs_plugin = pytest.mark.skipif(not PLUGIN.exists(), reason="profiler plugin not built (make -C native/profiler)")


def table(rank: int, groups: list[tuple[str, str, list[int]]], **extra) -> dict:
    return {
        "format": "comminsight.process_groups",
        "version": 1,
        "rank": rank,
        "groups": [
            {"name": n, "desc": d, "ranks": r, "size": len(r), "creation_index": i}
            for i, (n, d, r) in enumerate(groups)
        ],
        **extra,
    }


def test_a_node_that_sees_only_some_members_still_names_cross_node_groups_by_position():
    # 8 ranks, 4 per node: the DP group {1, 5} spans both nodes; node A sees only rank 1 of it
    tables = [
        table(
            1,
            [
                ("0", "default_pg", list(range(8))),
                ("2", "TENSOR_MODEL_PARALLEL_GROUP", [0, 1]),
                ("5", "DATA_PARALLEL_GROUP", [1, 5]),
            ],
        )
    ]
    observations = [
        Observation("0xdp", size=2, positions={1: 0}, first_seen_ns=5),
        Observation("0xtp", size=2, positions={1: 1}, first_seen_ns=3),
        Observation("0xworld", size=8, positions={1: 1, 2: 2}, first_seen_ns=1),
    ]
    names = name_communicators(observations, tables)
    assert names["0xdp"]["desc"] == "DATA_PARALLEL_GROUP"
    assert names["0xtp"]["desc"] == "TENSOR_MODEL_PARALLEL_GROUP"
    assert names["0xworld"]["ranks"] == list(range(8))


def test_a_comm_name_set_by_pytorch_is_read_as_desc_and_name_without_any_table():
    names = name_communicators(
        [Observation("0xa", size=2, positions={0: 0}, comm_name="PIPELINE_MODEL_PARALLEL_GROUP:7")], []
    )
    assert (names["0xa"]["desc"], names["0xa"]["name"], names["0xa"]["source"]) == (
        "PIPELINE_MODEL_PARALLEL_GROUP",
        "7",
        "comm_name",
    )


def test_reports_say_why_names_are_missing():
    observations = [Observation("0xa", size=2, positions={0: 0})]
    assert "comminsight inject install" in naming_summary(observations, {}, [])["reason"]
    hook_gave_up = [table(0, [], level=3, reason="this PyTorch's distributed_c10d lacks _world")]
    assert "lacks _world" in naming_summary(observations, {}, hook_gave_up)["reason"]


def make_archiver(home: Path) -> Archiver:
    spool = Spool(home / "spool", [], max_bytes=1 << 30, max_age_s=3600)
    archiver = Archiver(
        home / "inspector_logs",
        home / "hang_detection",
        home / "metadata" / "agent",
        spool,
        workload_id="job",
        node="n",
        host="h",
        node_ip="",
        orphan_grace_s=0.0,
        proc_root=home / "no-proc",
    )
    archiver.recover()
    return archiver


def simulate(home: Path, *args: str) -> None:
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
        "--layout",
        "megatron",
        "-n",
        "8",
        "--tp",
        "2",
        "--pp",
        "2",
        "--no-comm-names",
        *args,
    ]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert (home / "ground_truth.json").exists(), result.stdout + result.stderr


def hang_report(path: Path) -> dict:
    out = subprocess.run(
        [str(COMMINSIGHT), "analyze", "hang", str(path), "--format", "json"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.slow
@needs_plugin
def test_a_simulated_hang_names_its_stuck_groups_from_the_home_and_from_the_sealed_archive(tmp_path, caplog):
    home = tmp_path / "home"
    simulate(home, "--steps", "4", "-s", "hang", "-r", "5", "--step", "2", "--hang-timeout", "4")
    truth = json.loads((home / "ground_truth.json").read_text())
    kinds = {c["comm_hash"]: c["kind"] for c in truth["communicators"]}
    descs = {
        "tp": "TENSOR_MODEL_PARALLEL_GROUP",
        "pp": "PIPELINE_MODEL_PARALLEL_GROUP",
        "dp": "DATA_PARALLEL_GROUP",
        "mp": "MODEL_PARALLEL_GROUP",
        "world": "default_pg",
    }

    from_home = hang_report(home)
    stuck = [(g["group_id"], g["group_desc"]) for g in from_home["stuck_groups"]]
    assert stuck
    assert all(desc == descs[kinds[comm]] for comm, desc in stuck)
    assert from_home["names"]["named"] == from_home["names"]["communicators"]

    # a hostile table beside the good ones is skipped with a warning; the seal goes on
    (home / "metadata" / "process_groups-evil-1.json").write_text(
        '{"format": "comminsight.process_groups", "version": 1, "groups": [{"ranks": [-1]}]}'
    )
    caplog.set_level(logging.WARNING, logger="comminsight.agent.archiver")
    entry = make_archiver(home).seal(final=True)
    assert entry is not None
    assert "process_groups-evil-1.json" in caplog.text
    names = [name for name, _ in read_archive(entry.path)[1]]
    assert sum(n.startswith("metadata/") for n in names) == 8
    from_archive = hang_report(entry.path)
    assert from_archive["stuck_groups"]
    assert all(g["group_desc"] == descs[kinds[g["group_id"]]] for g in from_archive["stuck_groups"])

    trace = tmp_path / "trace.json"
    subprocess.run(
        [str(COMMINSIGHT), "export", "perfetto", str(entry.path), "-o", str(trace)],
        check=True,
        capture_output=True,
        timeout=240,
    )
    slice_names = {e["name"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"}
    assert any(n.endswith(" · TENSOR_MODEL_PARALLEL_GROUP") for n in slice_names)


@needs_plugin
def test_a_table_written_after_its_segments_were_archived_lands_in_the_next_archive(tmp_path):
    home = tmp_path / "home"
    simulate(home, "--steps", "2")
    tables = sorted((home / "metadata").glob("process_groups-*.json"))
    late = tables[0]
    moved = tmp_path / late.name
    late.replace(moved)  # its process had not written it yet when the first seal ran
    archiver = make_archiver(home)
    first = archiver.seal(final=True)
    assert f"metadata/{late.name}" not in [n for n, _ in read_archive(first.path)[1]]
    moved.replace(late)
    segment = next((home / "spool").glob("*.tar.zst"))  # any segment will do as the next seal's payload
    for name, data in read_archive(segment)[1]:
        if name.startswith("segments/"):
            (home / "inspector_logs" / (Path(name).name)).write_bytes(data)
            break
    second = archiver.seal(final=True)
    assert f"metadata/{late.name}" in [n for n, _ in read_archive(second.path)[1]]


def test_the_hang_report_of_a_real_8_rank_nccl_job_names_the_stuck_group_by_its_description():
    # PyTorch 2.11 / NCCL 2.28.9 on an H200; rank 5 skipped a data-parallel all-reduce (README beside the data)
    report = hang_report(Path(__file__).resolve().parents[1] / "data" / "inject_gpu_lab_8rank")
    (stuck,) = report["stuck_groups"]
    assert (stuck["group_desc"], stuck["op"], stuck["entered_ranks"], stuck["missing_ranks"]) == (
        "DATA_PARALLEL_GROUP",
        "all_reduce",
        [7],
        [5],
    )
    assert report["names"]["named"] == report["names"]["communicators"] == 12
