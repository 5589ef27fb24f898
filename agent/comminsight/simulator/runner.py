"""Run a simulated job: spawn one process per rank, watch it, end it, write the ground truth.

The parent never touches the plugin. It creates the arrival board, spawns the ranks
(multiprocessing "spawn": each is a fresh interpreter that loads the ``.so`` itself), reports
progress, and ends the run when no rank has made progress for the hang timeout (a hang, a crash
or anything else that stalls): with ``on_hang="abort"`` it raises the board's abort flag, and every
live rank — waiting ones and the hung one — stops waiting and finalizes its communicators, as
NCCL's watchdog would abort them (the plugin sees what is still in flight); with ``"kill"`` it
SIGKILLs every live rank, as a scheduler would. Then it merges the rank journals into
``<home>/ground_truth.json`` (format: docs/simulator.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from comminsight import lifeline
from comminsight.simulator.board import Board, RankStatus
from comminsight.simulator.plan import (
    SETUP_STEP,
    Crash,
    Hang,
    Launch,
    Plan,
    SimulationConfig,
    SlowLink,
    build_plan,
    compute_durations,
    config_to_dict,
    link_pairs,
)
from comminsight.simulator.spec import EXIT_ABORTED, RankSpec, rank_environment

GROUND_TRUTH_SCHEMA = 2  # 2: each launch's due time and host delay, each rank's origin, per-step model columns
STARTUP_TIMEOUT_S = 120.0
ABORT_GRACE_S = 15.0
DEFAULT_PLUGIN_ENV = {"COMMINSIGHT_AGENT_AUTOSTART": "0"}
PLUGIN_HANG_ENV = "COMMINSIGHT_HANG_TIMEOUT_S"


@dataclass
class Progress:
    """A snapshot for progress displays."""

    steps_done: list[int]
    statuses: list[RankStatus]
    total_steps: int
    ended_by: str | None = None


@dataclass
class SimulationResult:
    """Where the run left its output, and how each rank ended."""

    home: Path
    ground_truth_path: Path
    ground_truth: dict[str, Any]
    exit_codes: list[int | None]
    ended_by: str | None = None  # None (ran to the end), "abort" or "kill"
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def default_plugin_path() -> Path | None:
    """The plugin to drive when none is given: $COMMINSIGHT_PLUGIN, the source-tree build, <home>/lib."""
    candidates = []
    if os.environ.get("COMMINSIGHT_PLUGIN"):
        candidates.append(Path(os.environ["COMMINSIGHT_PLUGIN"]))
    source_tree = Path(__file__).resolve().parents[3] / "native/profiler/build/libnccl-profiler-comminsight.so"
    candidates += [
        source_tree,
        Path(os.environ.get("COMMINSIGHT_HOME", "/opt/comminsight")) / "lib/libnccl-profiler-comminsight.so",
    ]
    return next((c for c in candidates if c.is_file()), None)


def run_simulation(
    config: SimulationConfig,
    plugin: str | os.PathLike[str],
    home: str | os.PathLike[str],
    *,
    env: Mapping[str, str] | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    reuse_home: bool = False,
) -> SimulationResult:
    """Simulate ``config`` through ``plugin`` with output home ``home``; blocks until the run ended.

    ``env`` adds variables to every rank (plugin settings such as ``COMMINSIGHT_HANG_TIMEOUT_S``);
    by default agent autostart is switched off. Raises ValueError for a bad configuration,
    FileNotFoundError for a missing plugin and FileExistsError when ``home`` already holds raw logs
    (they would mix with this run's; ``reuse_home=True`` allows it), before anything is started.
    """
    plan = build_plan(config)
    plugin_path = Path(plugin).resolve()
    if not plugin_path.is_file():
        raise FileNotFoundError(f"profiler plugin {plugin_path} does not exist")
    home_path = Path(home).resolve()
    logs = home_path / "inspector_logs"
    if not reuse_home and logs.is_dir() and any(logs.iterdir()):
        raise FileExistsError(f"{logs} already holds raw logs; use an empty home (or reuse it deliberately)")
    home_path.mkdir(parents=True, exist_ok=True)
    workdir = home_path / "simulator"
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir()
    board_path = workdir / "board.bin"
    board = Board(board_path, config.ranks, int(plan.rendezvous_offsets[-1]), create=True)
    rank_env = {**DEFAULT_PLUGIN_ENV, **(env or {})}
    stall_s = config.effective_hang_timeout_s()
    if any(isinstance(f, Hang | Crash) for f in config.faults) and stall_s >= 2 and PLUGIN_HANG_ENV not in rank_env:
        # Let the plugin write its in-flight timeout evidence before the run is ended (it counts whole seconds).
        rank_env[PLUGIN_HANG_ENV] = str(max(1, int(stall_s // 2)))
    processes: list[subprocess.Popen] = []
    # A SIGTERM/SIGINT/SIGHUP to this process ends the ranks first, then this process.
    with lifeline.ForwardSignals(lambda: processes):
        return _run(config, plan, plugin_path, home_path, workdir, board, board_path, rank_env, processes, on_progress)


def _run(
    config: SimulationConfig,
    plan: Plan,
    plugin_path: Path,
    home_path: Path,
    workdir: Path,
    board: Board,
    board_path: Path,
    rank_env: dict[str, str],
    processes: list[subprocess.Popen],
    on_progress: Callable[[Progress], None] | None,
) -> SimulationResult:
    started = time.monotonic()
    started_ns = time.time_ns()
    for rank in range(config.ranks):
        spec = RankSpec(
            config, rank, str(plugin_path), str(home_path), str(board_path), str(workdir / f"rank-{rank:05d}.jsonl")
        )
        spec_path = workdir / f"rank-{rank:05d}.spec.json"
        spec_path.write_text(spec.to_json())
        # Each rank is a fresh interpreter with its own launcher environment, loading the plugin itself.
        # The rank ends with this process, however it ends (comminsight.lifeline).
        environment = lifeline.child_environment(
            {**os.environ, **rank_env, **rank_environment(config, rank, str(home_path))}
        )
        with open(workdir / f"rank-{rank:05d}.log", "wb") as output:
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "comminsight.simulator.rank", str(spec_path)],
                    env=environment,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            )
    ended_by = _supervise(config, board, processes, on_progress)
    for process in processes:
        process.wait()
    wall = time.monotonic() - started
    exit_codes = [p.returncode for p in processes]
    truth = ground_truth(plan, home_path, plugin_path, workdir, exit_codes, ended_by, started_ns)
    truth["rank_env"] = rank_env
    board.close()
    board_path.unlink(missing_ok=True)
    truth_path = home_path / "ground_truth.json"
    tmp = truth_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(truth, indent=1))
    tmp.replace(truth_path)
    return SimulationResult(home_path, truth_path, truth, exit_codes, ended_by, wall)


def _supervise(
    config: SimulationConfig,
    board: Board,
    processes: list,
    on_progress: Callable[[Progress], None] | None,
) -> str | None:
    timeout_ns = int(config.effective_hang_timeout_s() * 1e9)
    start = time.monotonic()
    ended_by: str | None = None
    abort_at = 0.0
    while any(p.poll() is None for p in processes):
        time.sleep(0.05)
        now_ns = time.time_ns()
        if on_progress is not None:
            on_progress(
                Progress(
                    [int(s) for s in board.steps_done],
                    [RankStatus(int(s)) for s in board.status],
                    config.steps,
                    ended_by,
                )
            )
        if ended_by is not None:
            if ended_by == "abort" and time.monotonic() - abort_at > ABORT_GRACE_S:
                _kill(processes)  # a rank that cannot even abort
                ended_by = "abort+kill"
            continue
        all_up = bool((board.status >= RankStatus.READY).all())
        died = any(p.poll() not in (None, 0) for p in processes)
        if not all_up:
            # A rank that died before communicator creation finished leaves the others waiting forever.
            if died or time.monotonic() - start > STARTUP_TIMEOUT_S:
                ended_by, abort_at = _end(config, board, processes), time.monotonic()
            continue
        if now_ns - int(board.heartbeat_ns.max()) > timeout_ns:
            ended_by, abort_at = _end(config, board, processes), time.monotonic()
    return ended_by


def _end(config: SimulationConfig, board: Board, processes: list) -> str:
    if config.on_hang == "kill":
        _kill(processes)
        return "kill"
    board.abort()
    return "abort"


def _kill(processes: list) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()


# ----------------------------------------------------------------------------- ground truth


def _read_journal(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    events = []
    for line in path.read_bytes().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            break  # a torn last line (killed mid-write)
    return events


def _outcome(events: list[dict[str, Any]], code: int | None) -> str:
    for event in reversed(events):
        if event["ev"] == "exit":
            return event["outcome"]
        if event["ev"] == "crash":
            return "crashed"
    if code is not None and code < 0:
        return "killed"
    return "failed" if code != EXIT_ABORTED else "aborted"


def _fault_json(plan: Plan, fault: Any) -> dict[str, Any]:
    data = asdict(fault)
    data["type"] = fault.type
    if isinstance(fault, Hang | Crash):
        data["blocked_ops"] = _blocked_ops(plan, fault)
    if isinstance(fault, SlowLink):
        data["crossed_by"] = _crossed_by(plan, fault)
    if "ranks" in data:
        data["ranks"] = list(data["ranks"])
    return data


def _crossed_by(plan: Plan, fault: SlowLink) -> list[dict[str, Any]]:
    """The communicators whose traffic crosses the slow link, with the functions that cross it."""
    funcs: dict[int, set[str]] = defaultdict(set)
    link = frozenset(fault.ranks)
    for op, members in zip(plan.rendezvous_ops, plan.rendezvous_members, strict=True):
        if link in link_pairs(op, members):
            funcs[op.comm].add(op.func)
    return [
        {
            "comm_hash": f"{plan.communicators[c].comm_hash:#018x}",
            "comm_name": plan.communicators[c].name,
            "ranks": list(plan.communicators[c].ranks),
            "funcs": sorted(funcs[c]),
        }
        for c in sorted(funcs)
    ]


def _blocked_ops(plan: Plan, fault: Hang | Crash) -> list[dict[str, Any]]:
    """The operations the stopped rank never issued, with the seq they would have had (the join key)."""
    schedule = plan.schedules[fault.rank]
    counters: dict[tuple, int] = defaultdict(int)
    for step, actions in [(SETUP_STEP, schedule.setup), *enumerate(schedule.steps)]:
        index = 0
        for action in actions:
            if not isinstance(action, Launch):
                continue
            if (step, index) == (fault.step, fault.op_index):
                blocked = []
                for op in action.ops:
                    comm = plan.communicators[op.comm]
                    key = (op.comm, op.func, op.peer if op.is_p2p else -1)
                    blocked.append(
                        {
                            "comm_hash": f"{comm.comm_hash:#018x}",
                            "comm_name": comm.name,
                            "func": op.func,
                            "seq": counters[key] if (comm.nranks > 1 or op.is_p2p) else None,
                            "peer": op.peer,
                            "waiting_ranks": [comm.ranks[op.peer]]
                            if op.is_p2p
                            else [r for r in comm.ranks if r != fault.rank],
                        }
                    )
                return blocked
            for op in action.ops:
                if plan.communicators[op.comm].nranks > 1 or op.is_p2p:
                    counters[(op.comm, op.func, op.peer if op.is_p2p else -1)] += 1
            index += 1
    return []


def ground_truth(
    plan: Plan,
    home: Path,
    plugin: Path,
    workdir: Path,
    exit_codes: list[int | None],
    ended_by: str | None,
    started_ns: int,
) -> dict[str, Any]:
    """Merge the rank journals with the plan into the ground-truth document (docs/simulator.md)."""
    config = plan.config
    ops: dict[str, list[Any]] = defaultdict(list)
    steps: dict[str, list[Any]] = defaultdict(list)
    ranks = []
    for rank, schedule in enumerate(plan.schedules):
        events = _read_journal(workdir / f"rank-{rank:05d}.jsonl")
        launches = [(SETUP_STEP, a) for a in schedule.setup if isinstance(a, Launch)]
        launches += [(s, a) for s, actions in enumerate(schedule.steps) for a in actions if isinstance(a, Launch)]
        enqueues = [e for e in events if e["ev"] == "enq"]
        completions = [e for e in events if e["ev"] == "done"]
        p2p_seq: dict[tuple, int] = defaultdict(int)
        for n, enqueue in enumerate(enqueues):
            step, launch = launches[n]
            done = completions[n] if n < len(completions) else None
            for i, op in enumerate(launch.ops):
                comm = plan.communicators[op.comm]
                seq = enqueue["seq"][i]
                if op.is_p2p:
                    seq = p2p_seq[(op.comm, op.func, op.peer)]
                    p2p_seq[(op.comm, op.func, op.peer)] += 1
                coll_count, coll_dtype = op.coll_count_dtype()
                ops["rank"].append(rank)
                ops["step"].append(step)
                ops["launch"].append(enqueue["launch"])
                ops["comm_index"].append(op.comm)
                ops["comm_hash"].append(f"{comm.comm_hash:#018x}")
                ops["comm_rank"].append(comm.comm_rank(rank))
                ops["func"].append(op.func)
                ops["seq"].append(seq)
                ops["peer"].append(op.peer)
                ops["count"].append(op.count)
                ops["dtype"].append(op.dtype)
                ops["coll_count"].append(coll_count)
                ops["coll_dtype"].append(coll_dtype)
                ops["bytes"].append(op.bytes)
                ops["role"].append(op.role)
                ops["recorded"].append(comm.nranks > 1 or op.is_p2p)
                ops["enqueue_start_ns"].append(enqueue["t0"])
                ops["enqueue_end_ns"].append(enqueue["t1"])
                ops["due_ns"].append(enqueue.get("due"))
                ops["host_delay_ns"].append(enqueue["t1"] - enqueue["due"] if "due" in enqueue else None)
                ops["gpu_start_ns"].append(done["gpu"][i][0] if done else None)
                ops["gpu_end_ns"].append(done["gpu"][i][1] if done else None)
                ops["status"].append("completed" if done else "in_flight")
        starts = {e["step"]: e["t"] for e in events if e["ev"] == "step_start"}
        ends = {e["step"]: e for e in events if e["ev"] == "step_end"}
        # Per step, what the rank did against its model: compute the plan gave it, what the machine added
        # to its launches (enqueued after they were due on the modelled clock), its loop's CPU time.
        modelled = [sum(d) for d in compute_durations(config, rank, schedule.steps)]
        delays: dict[int, int] = defaultdict(int)
        for enqueue in enqueues:
            if "due" in enqueue:
                delays[enqueue["step"]] += enqueue["t1"] - enqueue["due"]
        for step, start in sorted(starts.items()):
            end = ends.get(step, {})
            steps["step"].append(step)
            steps["rank"].append(rank)
            steps["start_ns"].append(start)
            steps["end_ns"].append(end.get("t"))
            steps["modelled_compute_ms"].append(modelled[step])
            steps["host_delay_ns"].append(delays[step])
            steps["loop_cpu_ns"].append(end.get("cpu"))
        start_event = next((e for e in events if e["ev"] == "start"), {})
        origin = next((e["t"] for e in events if e["ev"] == "origin"), None)
        env = rank_environment(config, rank, str(home))
        ranks.append(
            {
                "rank": rank,
                "node": plan.node_of_rank[rank],
                "node_ip": env["NODE_IP"],
                "local_rank": int(env["LOCAL_RANK"]),
                "pid": start_event.get("pid"),
                "origin_ns": origin,
                "coordinates": plan.coordinates[rank],
                "exit_code": exit_codes[rank],
                "outcome": _outcome(events, exit_codes[rank]),
                "steps_completed": len(ends),
                "launches_enqueued": len(enqueues),
                "launches_completed": len(completions),
            }
        )
    faults = [_fault_json(plan, f) for f in config.faults]
    return {
        "schema_version": GROUND_TRUTH_SCHEMA,
        "kind": "comminsight.simulation",
        "layout": config.layout,
        "world_size": config.ranks,
        "nodes": config.nodes,
        "abi": config.abi,
        "plugin": str(plugin),
        "home": str(home),
        "started_ns": started_ns,
        "ended_ns": time.time_ns(),
        "ended_by": ended_by,
        "config": config_to_dict(config),  # config_from_dict reads it back
        "communicators": [
            {
                "index": c.index,
                "name": c.name,
                "comm_name": c.name if config.comm_names else None,
                "kind": c.kind,
                "comm_hash": f"{c.comm_hash:#018x}",
                "nranks": c.nranks,
                "nnodes": c.nnodes,
                "ranks": list(c.ranks),
            }
            for c in plan.communicators
        ],
        "ranks": ranks,
        "faults": faults,
        "steps": dict(steps),
        "operations": dict(ops),
    }
