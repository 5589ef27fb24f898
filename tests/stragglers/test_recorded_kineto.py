"""Straggler attribution on Kineto traces recorded on a real GPU (tests/data/kineto_gpu_lab_8rank).

The traces come from the GPU lab (8 NCCL ranks, PyTorch profiler, one rank made slow on purpose);
the injected rank is read from the folder's meta.json, never written here.
"""

from __future__ import annotations

import json

from typer.testing import CliRunner

from comminsight.cli import app


def test_the_kineto_import_of_a_real_8_rank_job_names_the_injected_slow_rank_and_nobody_else(recorded_kineto) -> None:
    traces, meta = recorded_kineto
    result = CliRunner().invoke(app, ["analyze", "stragglers", str(traces), "--format", "json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert len(doc["ranks"]) == meta["ranks"]
    # The whole list: a healthy rank that only waited for the slow one, or had one slow step of its
    # own on a GPU time-shared by eight ranks, is not a culprit.
    assert doc["culprits"] == [meta["ground_truth"]["slow_rank"]]
    assert doc["slowdown"]["ratio"] > 1.0
