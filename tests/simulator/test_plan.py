"""Plans: layouts, communicators, rendezvous, deadlock checks, timing and configuration validation (in-process)."""

from __future__ import annotations

from collections import Counter

import pytest

from comminsight.simulator.plan import (
    Compute,
    Crash,
    Hang,
    Late,
    Launch,
    Op,
    RankSchedule,
    SimulationConfig,
    SlowLink,
    Straggler,
    build_plan,
    check_deadlock_free,
    compute_durations,
    config_from_dict,
    config_to_dict,
)

LAYOUTS = [
    SimulationConfig(layout="ddp", ranks=4),
    SimulationConfig(layout="fsdp", ranks=3, layers=3),
    SimulationConfig(layout="megatron", ranks=8, tp=2, pp=2, layers=1),
    SimulationConfig(layout="megatron", ranks=8, tp=1, pp=4, dp=2, nodes=2, micro_batches=3),
    SimulationConfig(layout="megatron", ranks=12, tp=2, pp=3, layers=2, micro_batches=1),
    SimulationConfig(layout="megatron", ranks=4, tp=4, pp=1),
]


@pytest.mark.parametrize("config", LAYOUTS, ids=lambda c: f"{c.layout}-{c.ranks}-tp{c.tp}-pp{c.pp}")
def test_every_layout_builds_complete_deadlock_free_schedules(config: SimulationConfig) -> None:
    plan = build_plan(config)  # raises on an incomplete rendezvous or a deadlock

    assert len(plan.schedules) == config.ranks
    assert all(len(s.steps) == config.steps for s in plan.schedules)
    assert plan.rendezvous_offsets[-1] == sum(len(m) for m in plan.rendezvous_members)
    assert (plan.transfer_ns > 0).all()


def test_communicators_hash_the_same_on_members_and_differ_between_groups() -> None:
    plan = build_plan(SimulationConfig(layout="megatron", ranks=8, tp=2, pp=2, layers=1))
    hashes = [c.comm_hash for c in plan.communicators]

    assert len(set(hashes)) == len(hashes)
    assert build_plan(SimulationConfig(layout="megatron", ranks=8, tp=2, pp=2, layers=1, seed=9)).communicators == (
        plan.communicators
    ), "hashes depend on the group, not on the run"


def test_megatron_groups_follow_megatrons_rank_order() -> None:
    plan = build_plan(SimulationConfig(layout="megatron", ranks=8, tp=2, pp=2, layers=1))
    groups = {c.name: c.ranks for c in plan.communicators}

    assert groups["tp0"] == (0, 1)
    assert groups["tp1"] == (2, 3)
    assert groups["dp0"] == (0, 2)
    assert groups["pp0"] == (0, 4)
    assert groups["mp0"] == (0, 1, 4, 5)
    assert plan.coordinates[5] == {"tp": 1, "dp": 0, "pp": 1}


def test_pipeline_stages_exchange_matching_sends_and_receives() -> None:
    plan = build_plan(SimulationConfig(layout="megatron", ranks=4, tp=1, pp=4, dp=1, micro_batches=4, steps=1))
    sent = Counter()
    received = Counter()
    for schedule in plan.schedules:
        for action in schedule.steps[0]:
            if isinstance(action, Launch):
                for op in action.ops:
                    comm = plan.communicators[op.comm]
                    if op.func == "Send":
                        sent[(schedule.rank, comm.ranks[op.peer])] += 1
                    elif op.func == "Recv":
                        received[(comm.ranks[op.peer], schedule.rank)] += 1

    assert sent == received
    assert sent[(0, 1)] == 4
    assert sent[(1, 0)] == 4
    assert (0, 2) not in sent


def test_one_rank_groups_get_no_rendezvous() -> None:
    plan = build_plan(SimulationConfig(layout="megatron", ranks=4, tp=2, pp=2, layers=1))  # dp == 1
    dp_ops = [
        op
        for action in plan.schedules[0].steps[0]
        if isinstance(action, Launch)
        for op in action.ops
        if plan.communicators[op.comm].kind == "dp"
    ]

    assert dp_ops
    assert all(op.rendezvous == -1 for op in dp_ops)


def test_a_schedule_that_would_deadlock_is_rejected() -> None:
    a, b = Op("AllReduce", 0, 1, "ncclFloat32", rendezvous=0), Op("AllReduce", 1, 1, "ncclFloat32", rendezvous=1)
    crossed = [
        RankSchedule(0, (), ((Launch((a,)), Compute(1.0, 1), Launch((b,))),)),
        RankSchedule(1, (), ((Launch((b,)), Compute(1.0, 1), Launch((a,))),)),
    ]
    with pytest.raises(ValueError, match="deadlock"):
        check_deadlock_free(crossed, [(0, 1), (0, 1)])


def test_a_straggler_slows_only_its_rank_and_only_from_its_step() -> None:
    config = SimulationConfig(ranks=4, steps=4, jitter=0.0, faults=(Straggler(2, 50.0, 2),))
    plan = build_plan(config)
    totals = {r: [sum(s) for s in compute_durations(config, r, plan.schedules[r].steps)] for r in range(4)}

    assert totals[0] == pytest.approx([config.step_ms] * 4)
    assert totals[2] == pytest.approx([20.0, 20.0, 30.0, 30.0])


def _phases(config: SimulationConfig, rank: int) -> list[list[tuple[str, float]]]:
    plan = build_plan(config)
    steps = plan.schedules[rank].steps
    labels = [[a.label for a in actions if isinstance(a, Compute)] for actions in steps]
    durations = compute_durations(config, rank, steps)
    return [list(zip(names, d, strict=True)) for names, d in zip(labels, durations, strict=True)]


def test_a_late_rank_starts_its_first_backward_phase_late_from_its_step() -> None:
    config = SimulationConfig(ranks=4, steps=3, jitter=0.0, faults=(Late(1, 7.0, from_step=1),))
    plain = _phases(SimulationConfig(ranks=4, steps=3, jitter=0.0), 1)
    late = _phases(config, 1)

    assert late[0] == plain[0]
    for step in (1, 2):
        extra = [b - a for (_, a), (_, b) in zip(plain[step], late[step], strict=True)]
        first_backward = [label for label, _ in late[step]].index("backward")
        assert extra[first_backward] == pytest.approx(7.0)
        assert sum(extra) == pytest.approx(7.0)  # once per step, nothing else moves
    assert _phases(config, 0) == _phases(SimulationConfig(ranks=4, steps=3, jitter=0.0), 0)


def test_a_straggler_limited_to_backward_slows_only_backward_phases() -> None:
    base = {"layout": "megatron", "ranks": 8, "tp": 2, "pp": 2, "layers": 1, "jitter": 0.0}
    plain = _phases(SimulationConfig(**base), 5)
    slow = _phases(SimulationConfig(**base, faults=(Straggler(5, 40.0, phase="backward"),)), 5)

    for (label, a), (_, b) in zip(plain[0], slow[0], strict=True):
        assert b == pytest.approx(a * 1.4 if label == "backward" else a)


def test_the_modelled_clock_charges_a_late_rank_once_per_step_and_a_slow_link_its_transfers() -> None:
    from comminsight.simulator.model import modelled_step_ms, modelled_steps

    ddp = SimulationConfig(ranks=4, steps=4, step_ms=100.0, jitter=0.0)
    late = SimulationConfig(ranks=4, steps=4, step_ms=100.0, jitter=0.0, faults=(Late(2, 9.0),))
    # Every rank waits for the late one at the next gradient all-reduce: each step is 9 ms longer.
    assert modelled_step_ms(late) - modelled_step_ms(ddp) == pytest.approx(9.0, abs=1e-6)
    bounds = modelled_steps(ddp)
    assert bounds.shape == (4, 4, 2)
    assert (bounds[:, 1:, 0] >= bounds[:, :-1, 1] - 1e-9).all()  # a rank's steps follow each other

    megatron = SimulationConfig(layout="megatron", ranks=4, tp=1, pp=2, layers=1, jitter=0.0)
    slow = SimulationConfig(**{**megatron.__dict__, "faults": (SlowLink((0, 2), 1000.0),)})
    assert modelled_step_ms(slow) > modelled_step_ms(megatron) * 1.05
    with pytest.raises(ValueError, match="not hangs"):
        modelled_steps(SimulationConfig(ranks=2, faults=(Hang(1, 1),)))


def test_jitter_is_reproducible_from_the_seed() -> None:
    config = SimulationConfig(ranks=2, jitter=0.2, seed=5)
    plan = build_plan(config)
    first = compute_durations(config, 1, plan.schedules[1].steps)

    assert first == compute_durations(config, 1, plan.schedules[1].steps)
    assert first != compute_durations(SimulationConfig(ranks=2, jitter=0.2, seed=6), 1, plan.schedules[1].steps)


def test_a_slow_link_slows_only_that_pairs_transfers() -> None:
    base = SimulationConfig(layout="megatron", ranks=4, tp=1, pp=2, layers=1, jitter=0.0)
    slow = SimulationConfig(**{**base.__dict__, "faults": (SlowLink((0, 2), 10.0),)})
    plain, slowed = build_plan(base), build_plan(slow)
    p2p = {
        op.rendezvous
        for schedule in plain.schedules
        for action in schedule.steps[0]
        if isinstance(action, Launch)
        for op in action.ops
        if op.is_p2p
    }
    ratio = {tuple(sorted(plain.rendezvous_members[i])): slowed.transfer_ns[i] / plain.transfer_ns[i] for i in p2p}

    assert ratio[(0, 2)] == pytest.approx(10.0, rel=1e-3)
    assert ratio[(1, 3)] == pytest.approx(1.0, rel=1e-3)


def _slowdown_by_comm_and_func(config: SimulationConfig, *links: SlowLink) -> dict[tuple[str, str], float]:
    """Per (communicator name, function): transfer time with ``links`` over without, one value per pair."""
    plain = build_plan(config)
    slowed = build_plan(SimulationConfig(**{**config.__dict__, "faults": links}))
    ratios: dict[tuple[str, str], set[float]] = {}
    for rv, op in enumerate(plain.rendezvous_ops):
        ratio = round(float(slowed.transfer_ns[rv] / plain.transfer_ns[rv]), 2)  # ns are whole
        ratios.setdefault((plain.communicators[op.comm].name, op.func), set()).add(ratio)
    assert all(len(values) == 1 for values in ratios.values()), ratios  # every instance alike
    return {k: values.pop() for k, values in ratios.items()}


def test_a_slow_link_slows_every_collective_whose_ring_crosses_it_and_nothing_else() -> None:
    # TP2 x PP2 x DP2: ranks 4 and 5 are the TP group of stage 1, DP replica 0; the model-parallel
    # group mp0 = (0, 1, 4, 5) has them as ring neighbours too.
    config = SimulationConfig(layout="megatron", ranks=8, tp=2, pp=2, layers=1, jitter=0.0)
    ratios = _slowdown_by_comm_and_func(config, SlowLink((4, 5), 10.0))

    slowed = {k: r for k, r in ratios.items() if r != 1.0}
    assert slowed == {("tp2", "AllReduce"): 10.0, ("mp0", "AllReduce"): 10.0}
    assert {comm for comm, _ in ratios} >= {"tp0", "tp1", "tp3", "dp0", "dp2", "pp0", "pp1", "mp1"}


def test_a_ring_collective_crosses_every_hop_and_a_broadcast_chain_all_but_the_one_back_to_its_root() -> None:
    ddp = SimulationConfig(layout="ddp", ranks=4, jitter=0.0)  # world ring 0-1-2-3-0, broadcast from 0

    middle = _slowdown_by_comm_and_func(ddp, SlowLink((1, 2), 6.0))
    closing = _slowdown_by_comm_and_func(ddp, SlowLink((3, 0), 6.0))

    assert middle == {("world", "Broadcast"): 6.0, ("world", "AllReduce"): 6.0}
    assert closing == {("world", "Broadcast"): 1.0, ("world", "AllReduce"): 6.0}


def test_of_two_slow_links_on_one_ring_the_slowest_sets_the_pace() -> None:
    ddp = SimulationConfig(layout="ddp", ranks=4, jitter=0.0)

    ratios = _slowdown_by_comm_and_func(ddp, SlowLink((0, 1), 4.0), SlowLink((2, 3), 10.0))

    assert ratios[("world", "AllReduce")] == 10.0


def test_the_modelled_clock_charges_a_slow_link_inside_a_collective_on_its_ring_only() -> None:
    from comminsight.simulator.model import modelled_step_ms

    base = SimulationConfig(layout="megatron", ranks=8, tp=2, pp=2, layers=1, micro_batches=2, steps=4, jitter=0.0)
    plain = modelled_step_ms(base)
    tp_link = modelled_step_ms(SimulationConfig(**{**base.__dict__, "faults": (SlowLink((4, 5), 200.0),)}))
    dp_link = modelled_step_ms(SimulationConfig(**{**base.__dict__, "faults": (SlowLink((0, 2), 100.0),)}))

    # Stage 1's TP all-reduces (8 a step, ~18 us each) on its critical path, x200: some 3.7 ms each.
    assert tp_link - plain > 8 * 2.0
    # DP 0's parameter all-gather and gradient reduce-scatter (~0.17 + 0.34 ms) x100, once a step each.
    assert dp_link - plain > 0.5 * (17 + 34)


def test_configuration_round_trips_through_plain_data() -> None:
    faults = (Straggler(1, 20, 1), Straggler(2, 10, 0, "backward"), Late(0, 5.0, 1, "forward"), Hang(0, 1, 2))
    config = SimulationConfig(layout="fsdp", ranks=3, faults=(*faults, SlowLink((0, 1))))

    assert config_from_dict(config_to_dict(config)) == config


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"layout": "ddp", "bogus": 1}, "unknown configuration fields"),
        ({"faults": [{"type": "meteor", "rank": 0}]}, "unknown fault type"),
        ({"faults": [{"rank": 0}]}, "unknown fault type"),
        ({"faults": [{"type": "late", "rank": 0, "delay_ms": 1.0, "phase": 3}]}, "phase must be a string"),
    ],
)
def test_hostile_configuration_data_is_rejected(data: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_from_dict(data)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"layout": "zero3"}, "unknown layout"),
        ({"ranks": 0}, "ranks must be"),
        ({"ranks": 100_000}, "ranks must be"),
        ({"ranks": 5, "nodes": 2}, "split evenly"),
        ({"steps": 0}, "steps must be"),
        ({"step_ms": -1}, "step time"),
        ({"jitter": 1.5}, "jitter"),
        ({"abi": 3}, "ABI"),
        ({"tp": 2}, "megatron layout only"),
        ({"layout": "megatron", "ranks": 6, "tp": 4}, "does not equal"),
        ({"faults": (Straggler(9, 10),)}, "rank 9 is not in"),
        ({"faults": (Straggler(1, -5),)}, "slow percentage"),
        ({"faults": (Straggler(1, 5, phase="lunch"),)}, "phase must be one of"),
        ({"faults": (Late(1, 0.0),)}, "delay must be"),
        ({"faults": (Late(1, 5.0, phase=""),)}, "phase must be one of"),
        ({"faults": (Late(1, 5.0, from_step=9),)}, "from-step 9"),
        ({"faults": (Hang(1, 99),)}, "step 99"),
        ({"faults": (Hang(1, 1, 50),)}, "op index 50 is out of range"),
        ({"faults": (Crash(1, 1, exit_code=0),)}, "exit code"),
        ({"faults": (Hang(1, 1), Crash(1, 2))}, "only once"),
        ({"faults": (SlowLink((1, 1)),)}, "must differ"),
        ({"faults": (SlowLink((0, 2)),)}, "no traffic crosses ranks 0 and 2"),
    ],
)
def test_bad_configurations_are_rejected_with_a_clear_message(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_plan(SimulationConfig(**options))


def _truth_with_host_delays(config: SimulationConfig, delay_ms) -> dict:  # type: ignore[no-untyped-def]
    """A ground truth whose only content is each launch's host delay: ``delay_ms(rank, step, launch, last)``."""
    plan = build_plan(config)
    ops: dict[str, list] = {"rank": [], "step": [], "launch": [], "host_delay_ns": []}
    for rank, schedule in enumerate(plan.schedules):
        for step, actions in [(-1, schedule.setup), *enumerate(schedule.steps)]:
            launches = [a for a in actions if isinstance(a, Launch)]
            for index, launch in enumerate(launches):
                for _ in launch.ops:
                    ops["rank"].append(rank)
                    ops["step"].append(step)
                    ops["launch"].append(index)
                    ops["host_delay_ns"].append(int(delay_ms(rank, step, index, index == len(launches) - 1) * 1e6))
    ranks = [{"rank": r, "outcome": "completed", "origin_ns": 0} for r in range(config.ranks)]
    return {"config": config_to_dict(config), "ranks": ranks, "operations": ops}


def test_the_machine_made_lateness_of_a_rank_is_charged_to_that_rank_alone() -> None:
    from comminsight.simulator.model import host_delay_costs

    config = SimulationConfig(ranks=4, steps=4, step_ms=100.0, jitter=0.0)
    # Every launch enqueued 0.5 ms after it was due, but rank 2's loss all-reduce (its step's last launch)
    # 9.5 ms after: every rank's loss read waits 9 ms more, in every step.
    truth = _truth_with_host_delays(config, lambda rank, step, launch, last: 9.5 if rank == 2 and last else 0.5)
    costs = host_delay_costs(truth, {"rank 2": [2], "rank 0": [0], "ranks 0 1 3": [0, 1, 3]})
    assert costs["rank 2"] == pytest.approx(9.0, abs=1e-6)
    assert costs["rank 0"] == pytest.approx(0.0, abs=1e-6)
    assert costs["ranks 0 1 3"] == pytest.approx(0.0, abs=1e-6)


def test_a_faults_slowdown_in_a_run_is_the_plans_when_the_machine_added_nothing() -> None:
    from comminsight.simulator.model import fault_slowdown, modelled_step_ms

    late = SimulationConfig(ranks=4, steps=4, step_ms=100.0, jitter=0.0, faults=(Late(2, 9.0),))
    plain = modelled_step_ms(late) / modelled_step_ms(SimulationConfig(ranks=4, steps=4, step_ms=100.0, jitter=0.0))
    assert fault_slowdown(_truth_with_host_delays(late, lambda *_: 0.0)) == pytest.approx(plain, abs=1e-9)
    # The machine made rank 2's loss all-reduce 9 ms late as well: its share dilutes the fault's, and the job
    # without rank 2's slowness (the fault and the machine's) is faster than the job without the fault alone.
    truth = _truth_with_host_delays(late, lambda rank, step, launch, last: 9.0 if rank == 2 and last else 0.0)
    assert fault_slowdown(truth) < plain < fault_slowdown(truth, ranks=[2])
