"""The simulated job on a modelled clock: what a plan's timing model says, without running anything.

The rank processes of ``run`` sleep for real, so their times carry what the machine adds (scheduling,
wake-ups, a loaded CPU). ``modelled_steps`` replays the same plan with the same compute durations
(``compute_durations``: same seed, same jitter draws) and transfer times, by the rules the rank
processes follow (comminsight.simulator.rank): the training loop runs compute phases back to back,
a phase first waits for the launches it consumes, launches are enqueued at once; each GPU stream
runs its launches in order, a launch starts when the stream reaches it, every operation ends at its
last member's arrival plus its transfer time, and the launch ends with its last operation. No
machine noise, so a fault's cost is the modelled job with it over the modelled job without it.
Stragglers, late ranks and slow links are modelled (a slow link through the plan's transfer times,
which the rank processes use too: Send/Recv across it and every collective whose ring crosses it);
a job that hangs, crashes or pauses is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from comminsight.simulator.plan import (
    Compute,
    Crash,
    Hang,
    Launch,
    Pause,
    Plan,
    SimulationConfig,
    build_plan,
    compute_durations,
    config_from_dict,
)


def modelled_steps(
    config: SimulationConfig,
    plan: Plan | None = None,
    host_delays: Sequence[np.ndarray] | None = None,
    origins_ms: Sequence[float] | None = None,
) -> np.ndarray:
    """Per rank and step, (start, end) in ms on the modelled clock: shape (ranks, steps, 2).

    ``host_delays`` (per rank, one entry per launch in program order, set-up first, in ms) delays each
    launch's enqueue past its modelled time, as the machine delayed it in a run (``recorded_host_delays``);
    ``origins_ms`` starts each rank's clock where its run started.
    """
    return _replay(config, plan, host_delays, origins_ms)[0]


def _replay(
    config: SimulationConfig,
    plan: Plan | None,
    host_delays: Sequence[np.ndarray] | None,
    origins_ms: Sequence[float] | None,
) -> tuple[np.ndarray, list[list[tuple[float, float]]]]:
    """``modelled_steps``, and per rank each launch's (GPU start, GPU end) in ms, in program order."""
    if any(isinstance(f, Hang | Crash | Pause) for f in config.faults):
        raise ValueError(
            "the modelled clock covers stragglers, late ranks and slow links, not hangs, crashes or pauses"
        )
    plan = plan or build_plan(config, check=False)
    n = config.ranks
    programs: list[list[tuple[int, object, float]]] = []  # (step, action, compute ms)
    for rank, schedule in enumerate(plan.schedules):
        durations = compute_durations(config, rank, schedule.steps)
        program: list[tuple[int, object, float]] = [(-1, a, 0.0) for a in schedule.setup]
        for step, actions in enumerate(schedule.steps):
            computes = iter(durations[step])
            program += [(step, a, next(computes) if isinstance(a, Compute) else 0.0) for a in actions]
        programs.append(program)
    delays = [np.zeros(sum(isinstance(a, Launch) for _, a, _ in p)) for p in programs]
    if host_delays is not None:
        delays = [np.asarray(d, dtype=float) for d in host_delays]
        if [len(d) for d in delays] != [sum(isinstance(a, Launch) for _, a, _ in p) for p in programs]:
            raise ValueError("host delays need one entry per launch of every rank")
    cpu = [0] * n  # next action
    t_cpu = [float(o) for o in origins_ms] if origins_ms is not None else [0.0] * n
    issued = [0] * n  # launches enqueued
    queue: list[list[tuple[Launch, float]]] = [[] for _ in range(n)]  # enqueued launches, enqueue time
    stream_free = [0.0] * n
    done: list[list[float]] = [[] for _ in range(n)]  # completion time of each launch, in order
    gpu: list[list[tuple[float, float]]] = [[] for _ in range(n)]
    arrivals: dict[int, list[float]] = {}
    posted = [False] * n
    start_of = [0.0] * n
    bounds = np.full((n, config.steps, 2), np.nan)
    progress = True
    while progress:
        progress = False
        for r in range(n):
            program = programs[r]
            while cpu[r] < len(program):
                step, action, ms = program[cpu[r]]
                if step >= 0 and np.isnan(bounds[r, step, 0]):
                    bounds[r, step, 0] = t_cpu[r]
                if isinstance(action, Compute):
                    if len(done[r]) < action.after:
                        break
                    ready = done[r][action.after - 1] if action.after else 0.0
                    t_cpu[r] = max(t_cpu[r], ready) + ms
                else:
                    assert isinstance(action, Launch)
                    queue[r].append((action, t_cpu[r] + delays[r][issued[r]]))
                    issued[r] += 1
                cpu[r] += 1
                if step >= 0:
                    bounds[r, step, 1] = t_cpu[r]
                progress = True
            while queue[r]:
                launch, enqueued = queue[r][0]
                if not posted[r]:
                    start_of[r] = max(stream_free[r], enqueued)
                    for op in launch.ops:
                        if op.rendezvous >= 0:
                            arrivals.setdefault(op.rendezvous, []).append(start_of[r])
                    posted[r] = True
                    progress = True
                rvs = [op.rendezvous for op in launch.ops if op.rendezvous >= 0]
                if any(len(arrivals[rv]) < len(plan.rendezvous_members[rv]) for rv in rvs):
                    break
                # A one-rank communicator's operation is a device copy (rank.py's time for it).
                ends = [
                    max(arrivals[op.rendezvous]) + plan.transfer_ns[op.rendezvous] / 1e6
                    if op.rendezvous >= 0
                    else start_of[r] + (2_000 + op.bytes // 1000) / 1e6
                    for op in launch.ops
                ]
                stream_free[r] = max(ends, default=start_of[r])
                done[r].append(stream_free[r])
                gpu[r].append((start_of[r], stream_free[r]))
                queue[r].pop(0)
                posted[r] = False
                progress = True
    if any(cpu[r] < len(programs[r]) or queue[r] for r in range(n)):
        raise ValueError("the plan cannot run to its end (a layout bug)")
    return bounds, gpu


def _step_ms(bounds: np.ndarray) -> float:
    return float((np.nanmax(bounds[:, :, 1]) - np.nanmin(bounds[:, 0, 0])) / bounds.shape[1])


def modelled_step_ms(config: SimulationConfig) -> float:
    """The modelled job's mean step: first step's earliest start to last step's latest end, per step."""
    return _step_ms(modelled_steps(config))


# ----------------------------------------------------------------------------- a run's own truth


def recorded_host_delays(truth: dict) -> tuple[list[np.ndarray], np.ndarray]:
    """From a run's ground truth: per rank, each launch's host delay in ms (program order, set-up first),
    and where each rank's clock started, in ms after the earliest rank's.

    A launch's host delay is how long after it was due on the modelled clock the rank enqueued it: what
    the machine added to that rank (a late wake-up, a slow enqueue), not what the job asked for.
    """
    ranks = truth["ranks"]
    if any(r["outcome"] != "completed" or r.get("origin_ns") is None for r in ranks):
        raise ValueError("host delays are recorded for runs whose ranks all completed (schema with due_ns)")
    ops = truth["operations"]
    # One row per launch: its ops share the launch's enqueue, hence its delay.
    seen: dict[tuple[int, int, int], float] = {}
    for rank, step, launch, delay in zip(ops["rank"], ops["step"], ops["launch"], ops["host_delay_ns"], strict=True):
        seen.setdefault((rank, step, launch), delay / 1e6)
    delays = [np.array([seen[k] for k in sorted(k for k in seen if k[0] == r["rank"])]) for r in ranks]
    origins = np.array([r["origin_ns"] for r in ranks], dtype=np.int64)
    return delays, (origins - origins.min()) / 1e6


def replayed_launches(truth: dict) -> list[list[tuple[float, float]]]:
    """Per rank, each launch's (GPU start, GPU end) in ms after the earliest rank's origin, replayed on the
    modelled clock with the run's own host delays: what the run's GPU times are, if its truth is whole."""
    config = config_from_dict(truth["config"])
    delays, origins = recorded_host_delays(truth)
    return _replay(config, None, delays, origins)[1]


def host_delay_costs(truth: dict, subsets: Mapping[str, Sequence[int]]) -> dict[str, float]:
    """ms per step the machine cost the job through each subset of ranks, from the run's own truth.

    On the modelled clock with every launch delayed as recorded, minus the same where the subset's launches
    are delayed only as much as the run's typical launch (the median recorded delay): what the job
    would have saved had the machine treated those ranks like the others. A straggler that an analysis
    names in a run without an injected fault is machine-made exactly when this explains its cost.
    """
    config = config_from_dict(truth["config"])
    delays, origins = recorded_host_delays(truth)
    plan = build_plan(config, check=False)
    actual = _step_ms(_replay(config, plan, delays, origins)[0])
    return {
        name: actual - _step_ms(_replay(config, plan, _typical(delays, ranks), origins)[0])
        for name, ranks in subsets.items()
    }


def fault_slowdown(truth: dict, ranks: Sequence[int] = ()) -> float:
    """The injected faults' slowdown in the run that happened: its modelled clock with the faults over the
    same without them, every launch delayed as the machine delayed it in the run (``recorded_host_delays``).

    Without the delays this is ``modelled_step_ms`` with / without the faults, the job the plan describes;
    with them, the job as this machine ran it, whose extra time dilutes the faults' share. ``ranks``: their
    launches are, in the run without the faults, delayed only as much as the run's typical launch (their
    share of the machine's delays removed too: what "the job without these ranks' slowness" means for an
    analysis that cannot tell an injected slowness from one the machine made).
    """
    config = config_from_dict(truth["config"])
    delays, origins = recorded_host_delays(truth)
    as_run = _step_ms(_replay(config, None, delays, origins)[0])
    return as_run / _step_ms(_replay(dataclasses.replace(config, faults=()), None, _typical(delays, ranks), origins)[0])


def _typical(delays: list[np.ndarray], ranks: Sequence[int]) -> list[np.ndarray]:
    """``delays`` with those of ``ranks`` set to the run's typical launch delay (the median of all)."""
    typical = float(np.median(np.concatenate(delays)))
    chosen = set(ranks)
    return [np.full(len(d), typical) if r in chosen else d for r, d in enumerate(delays)]
