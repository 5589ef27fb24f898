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
)


def modelled_steps(config: SimulationConfig, plan: Plan | None = None) -> np.ndarray:
    """Per rank and step, (start, end) in ms on the modelled clock: shape (ranks, steps, 2)."""
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
    cpu = [0] * n  # next action
    t_cpu = [0.0] * n
    queue: list[list[tuple[Launch, float]]] = [[] for _ in range(n)]  # enqueued launches, enqueue time
    stream_free = [0.0] * n
    done: list[list[float]] = [[] for _ in range(n)]  # completion time of each launch, in order
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
                    queue[r].append((action, t_cpu[r]))
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
                ends = [max(arrivals[rv]) + plan.transfer_ns[rv] / 1e6 for rv in rvs] or [start_of[r]]
                stream_free[r] = max(ends)
                done[r].append(stream_free[r])
                queue[r].pop(0)
                posted[r] = False
                progress = True
    if any(cpu[r] < len(programs[r]) or queue[r] for r in range(n)):
        raise ValueError("the plan cannot run to its end (a layout bug)")
    return bounds


def modelled_step_ms(config: SimulationConfig) -> float:
    """The modelled job's mean step: first step's earliest start to last step's latest end, per step."""
    bounds = modelled_steps(config)
    return float((np.nanmax(bounds[:, :, 1]) - np.nanmin(bounds[:, 0, 0])) / config.steps)
