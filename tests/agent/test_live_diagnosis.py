"""Live root cause: the CLI's hang chain analysis over the agent's live state names the rank that stopped first."""

from __future__ import annotations

import base64
import time

import numpy as np
from pywriter import make_records

from comminsight.agent.diagnosis import NodeEvidence, diagnose
from comminsight.agent.state import LiveState
from comminsight.formats import header

C = header.constants()
WORLD = 0x5151


def job_state(stuck_rank: int, n: int = 8, done: int = 10, *, snapshot: int = C["CI_STATE_INFLIGHT"]) -> LiveState:
    """n ranks (one pid each) completed seqs 0..done-1; all but ``stuck_rank`` are in flight at seq ``done``."""
    state = LiveState(hang_floor_s=1.0)
    t0 = time.time_ns() - 60_000_000_000
    for rank in range(n):
        pid = 1000 + rank
        state.set_global_rank(pid, rank)
        ops = make_records(done, comm_hash=WORLD, rank=rank, nranks=n, pid=pid, start_ns=t0, comm_name="world")
        state.apply(str(pid), ops)
        if rank != stuck_rank:
            snap = make_records(
                1,
                comm_hash=WORLD,
                rank=rank,
                nranks=n,
                pid=pid,
                first_seq=done,
                first_record_seq=done,
                state=snapshot,
                start_ns=t0 + 1_000_000,
                comm_name="world",
            )
            snap["complete_ns"] = 0
            header.seal_records(snap)
            state.apply(str(pid), snap)
    return state


def test_live_state_names_the_rank_that_never_entered_as_root_cause() -> None:
    state = job_state(stuck_rank=5)
    suspicions, _ = state.detect_hangs()
    assert suspicions
    assert suspicions[0]["never_entered"] == [5]
    result = diagnose([NodeEvidence("node-a", state.evidence_records(), dict(state.pid_global_rank))])
    assert result is not None
    assert result["root_cause_ranks"] == [5]
    assert result["first_stuck"]["comm_hash"] == f"0x{WORLD:016x}"
    assert result["first_stuck"]["op"] == "all_reduce"
    assert result["first_stuck"]["seq"] == 10
    assert result["first_stuck"]["ranks"] == [5]


def test_a_master_merges_the_evidence_of_its_slaves_before_the_analysis() -> None:
    state = job_state(stuck_rank=6)
    records = state.evidence_records()
    ranks = state.pid_global_rank
    # Ranks 0-3 on this node, 4-7 on a slave that sent its evidence in its report.
    local = records[np.isin(records["pid"], [1000, 1001, 1002, 1003])]
    remote = records[~np.isin(records["pid"], [1000, 1001, 1002, 1003])]
    slave_doc = NodeEvidence("node-b", remote, {p: r for p, r in ranks.items() if p >= 1004}).to_json()
    merged = [NodeEvidence("node-a", local, dict(ranks)), NodeEvidence.from_json("node-b", slave_doc)]
    result = diagnose(merged)
    assert result is not None
    assert result["root_cause_ranks"] == [6]


def test_evidence_from_a_slave_with_damaged_records_keeps_only_the_valid_ones() -> None:
    state = job_state(stuck_rank=2, n=4)
    records = state.evidence_records()
    doc = NodeEvidence("node-b", records, dict(state.pid_global_rank)).to_json()
    raw = bytearray(records.tobytes())
    raw[20] ^= 0xFF  # one record's body no longer matches its checksum
    doc["records"] = base64.b64encode(bytes(raw)).decode()
    parsed = NodeEvidence.from_json("node-b", doc)
    assert len(parsed.records) == len(records) - 1


def test_no_suspicion_means_no_diagnosis() -> None:
    state = LiveState()
    state.apply("1", make_records(5, pid=1))
    assert diagnose([NodeEvidence("n", state.evidence_records(), {1: 0})]) is None


def test_live_evidence_survives_a_checkpoint_round_trip() -> None:
    state = job_state(stuck_rank=3, n=4)
    restored = LiveState(hang_floor_s=1.0)
    restored.restore(state.to_json())
    result = diagnose([NodeEvidence("n", restored.evidence_records(), dict(restored.pid_global_rank))])
    assert result is not None
    assert result["root_cause_ranks"] == [3]


def test_a_master_agent_names_a_root_cause_that_sits_on_a_slave(tmp_path) -> None:
    from comminsight.agent.config import load_config
    from comminsight.agent.daemon import Agent

    job = job_state(stuck_rank=6)
    records, ranks = job.evidence_records(), job.pid_global_rank
    on_slave = np.isin(records["pid"], [1004, 1005, 1006, 1007])
    config = load_config(env={"COMMINSIGHT_AGENT_SAMPLE_INTERVAL": "0", "NODE_IP": "10.0.0.1"}, home=tmp_path)
    master = Agent(config)
    # The master's own ranks 0-3 are inside the stuck collective; ranks 4-7 report from a slave.
    for pid in (1000, 1001, 1002, 1003):
        master.state.set_global_rank(pid, ranks[pid])
    master.state.apply("local", records[~on_slave])
    slave = NodeEvidence("10.0.0.2", records[on_slave], {p: r for p, r in ranks.items() if p >= 1004})
    slave_step = {
        "rank": 6,
        "step": 3,
        "start_ns": 1,
        "end_ns": 2,
        "duration_s": 1.0,
        "comm_s": 0.5,
        "ops": 5,
        "bytes": 9,
    }
    master.cluster.accept(
        {"node": "10.0.0.2", "communicators": [], "hang": [], "evidence": slave.to_json(), "steps": [slave_step]}
    )
    suspicions, _ = master.state.detect_hangs()
    master._diagnose(suspicions, True)
    assert master.diagnosis is not None
    assert master.diagnosis["root_cause_ranks"] == [6]
    assert master.hang_view()["root_cause_ranks"] == [6]
    beat = master.live_payload()
    assert beat["hang"]["root_cause_ranks"] == [6]
    assert beat["steps"] == [slave_step]  # the slave's latest step travels in the master's heartbeat


def test_evidence_sent_to_another_agent_or_the_site_is_capped_keeping_operations_in_flight_first() -> None:
    state = job_state(stuck_rank=5, n=8, done=10)
    evidence = NodeEvidence("n", state.evidence_records(), dict(state.pid_global_rank))
    inflight = evidence.records["state"] == C["CI_STATE_INFLIGHT"]
    capped = evidence.capped(int(inflight.sum()) + 2)
    assert len(capped.records) == int(inflight.sum()) + 2
    assert (capped.records["state"] == C["CI_STATE_INFLIGHT"]).sum() == inflight.sum()
    assert evidence.capped(len(evidence.records)) is evidence  # under the cap: sent whole


def test_a_master_sends_its_evidence_to_the_site_while_the_site_says_the_job_is_hung(tmp_path) -> None:
    from comminsight.agent.config import load_config
    from comminsight.agent.daemon import Agent

    config = load_config(env={"COMMINSIGHT_AGENT_SAMPLE_INTERVAL": "0", "NODE_IP": "10.0.0.2"}, home=tmp_path)
    agent = Agent(config)
    job = job_state(stuck_rank=6)
    for pid, rank in job.pid_global_rank.items():
        agent.state.set_global_rank(pid, rank)
    agent.state.apply("local", job.evidence_records())
    assert "evidence" not in agent.report_payload()  # nothing suspected here, the site said nothing
    agent.reporter.site_status = "hung"  # another node's agent reported the hang to the site
    sent = agent.report_payload()["evidence"]
    assert [e["node"] for e in sent] == ["10.0.0.2"]
    parsed = NodeEvidence.from_json("10.0.0.2", sent[0])
    assert len(parsed.records) == len(job.evidence_records())
