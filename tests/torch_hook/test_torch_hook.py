"""The PyTorch import hook, exercised in real torch.distributed jobs (gloo on the CPU, two processes)."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from comminsight.torch_hook import join_process_groups, load_tables

pytest.importorskip("torch.distributed")

TRAINING_SCRIPT = textwrap.dedent(
    """
    import os, sys
    {prelude}
    import torch
    import torch.distributed as dist
    {postlude}
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=int(os.environ["RANK"]),
                            world_size=2)
    tp = dist.new_group([0, 1], group_desc="TENSOR_MODEL_PARALLEL_GROUP")
    dp = dist.new_group([0, 1], group_desc="DATA_PARALLEL_GROUP")
    t = torch.ones(4)
    dist.all_reduce(t, group=tp)
    dist.all_reduce(t, group=dp)
    assert t.tolist() == [4.0] * 4, t
    dist.destroy_process_group()
    print("TRAINING-OK")
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_job(tmp_path: Path, home: Path, prelude: str = "", postlude: str = "", via_module: bool = False) -> list:
    script = tmp_path / "train.py"
    script.write_text(TRAINING_SCRIPT.format(prelude=prelude, postlude=postlude, port=_free_port()))
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "COMMINSIGHT_HOME": str(home)}
        argv = (
            [sys.executable, "-m", "comminsight.torch_hook", str(script)]
            if via_module
            else [sys.executable, str(script)]
        )
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = [p.communicate(timeout=120) for p in procs]
    for proc, (out, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err
        assert "TRAINING-OK" in out
    return results


def test_running_through_the_hook_records_every_group_with_its_description_and_members(tmp_path):
    home = tmp_path / "home"
    _run_job(tmp_path, home, via_module=True)
    tables = load_tables(home)
    assert sorted(t["rank"] for t in tables) == [0, 1]
    for table in tables:
        descs = [(g["desc"], g["ranks"], g["creation_index"]) for g in table["groups"]]
        assert ("TENSOR_MODEL_PARALLEL_GROUP", [0, 1], 1) in descs
        assert ("DATA_PARALLEL_GROUP", [0, 1], 2) in descs
        assert table["world_size"] == 2


def test_installing_after_torch_was_imported_records_the_groups_too(tmp_path):
    home = tmp_path / "home"
    _run_job(tmp_path, home, postlude="import comminsight.torch_hook as h; h.install()")
    (table, _) = load_tables(home)
    assert [g["desc"] for g in table["groups"]][1:] == ["TENSOR_MODEL_PARALLEL_GROUP", "DATA_PARALLEL_GROUP"]


def test_an_unwritable_home_does_not_break_training(tmp_path):
    home = tmp_path / "not-a-dir"
    home.write_text("a file where the home should be")
    results = _run_job(tmp_path, home, prelude="import comminsight.torch_hook as h; h.install()")
    assert any("could not record the process-group table" in err for _, err in results)


def test_communicators_with_the_same_members_are_named_in_creation_order():
    tables = [
        {
            "groups": [
                {"name": "0", "desc": "default_pg", "ranks": [0, 1, 2, 3], "creation_index": 0},
                {"name": "1", "desc": "TENSOR_MODEL_PARALLEL_GROUP", "ranks": [0, 1], "creation_index": 1},
                {"name": "2", "desc": "DATA_PARALLEL_GROUP", "ranks": [0, 1], "creation_index": 2},
            ]
        }
    ]
    communicators = [
        {"comm_id": "0xdp", "ranks": [1, 0], "first_seen_ns": 200},
        {"comm_id": "0xtp", "ranks": [0, 1], "first_seen_ns": 100},
        {"comm_id": "0xworld", "ranks": [3, 2, 1, 0], "first_seen_ns": 50},
        {"comm_id": "0xp2p", "ranks": [2, 3], "first_seen_ns": 10},
        {"comm_id": "0xother", "ranks": [4, 5], "first_seen_ns": 10},
    ]
    names = join_process_groups(communicators, tables)
    assert names["0xtp"]["desc"] == "TENSOR_MODEL_PARALLEL_GROUP"
    assert names["0xdp"]["desc"] == "DATA_PARALLEL_GROUP"
    assert names["0xworld"]["name"] == "0"
    assert names["0xtp"]["source"] == names["0xdp"]["source"] == "creation_order"
    assert "ambiguous" in names["0xtp"]["note"]
    # PyTorch's send/recv between two ranks of a larger group gets its own two-rank communicator
    assert (names["0xp2p"]["desc"], names["0xp2p"]["source"]) == ("default_pg", "p2p")
    assert "0xother" not in names


def test_malformed_metadata_files_are_skipped_with_a_warning_naming_each(tmp_path, caplog, monkeypatch):
    # Logging set-up elsewhere in the session (Celery's worker, for one) may have silenced these loggers.
    for name in ("comminsight", "comminsight.process_groups"):
        monkeypatch.setattr(logging.getLogger(name), "propagate", True)
        monkeypatch.setattr(logging.getLogger(name), "disabled", False)
    caplog.set_level(logging.WARNING, logger="comminsight.process_groups")
    metadata = tmp_path / "metadata"
    metadata.mkdir()
    good = {"format": "comminsight.process_groups", "version": 1, "groups": [{"name": "1", "ranks": [0, 1]}]}
    bad = {
        "process_groups-a-1.json": "{not json",
        "process_groups-a-2.json": json.dumps({"format": "something else", "groups": []}),
        "process_groups-a-3.json": json.dumps([1, 2, 3]),
        "process_groups-a-5.json": json.dumps(good)[:40],  # truncated
        "process_groups-a-6.json": json.dumps({**good, "groups": [{"name": "x", "ranks": ["0; rm -rf /"]}]}),
        "process_groups-a-7.json": json.dumps({**good, "groups": [{"name": "x" * 10_000, "ranks": [0]}]}),
    }
    for name, text in bad.items():
        (metadata / name).write_text(text)
    (metadata / "process_groups-a-8.json").write_bytes(b" " * (17 << 20))  # oversized
    (metadata / "process_groups-a-4.json").write_text(json.dumps(good))
    (table,) = load_tables(tmp_path)
    assert [g["ranks"] for g in table["groups"]] == [[0, 1]]
    for name in [*bad, "process_groups-a-8.json"]:
        assert name in caplog.text
