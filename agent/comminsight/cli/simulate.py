"""``comminsight simulate``: drive the real profiler plugin as NCCL would, one process per rank.

``run`` simulates a job (layout, size, steps, an optional injected fault) and writes the plugin's
output plus ``ground_truth.json`` into the output home; ``plan`` prints what a configuration would
do (communicators, launches per step) without starting anything. See docs/simulator.md.
"""

from __future__ import annotations

from collections import Counter
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from comminsight.cli.errors import fail

if TYPE_CHECKING:
    from comminsight.simulator.plan import Fault, SimulationConfig

app = typer.Typer(help="Simulate a training job through the real profiler plugin.", no_args_is_help=True)


class Layout(str, Enum):
    """Parallel layouts the simulator knows."""

    ddp = "ddp"
    fsdp = "fsdp"
    megatron = "megatron"


class Scenario(str, Enum):
    """Faults that can be injected."""

    none = "none"
    straggler = "straggler"
    late = "late"
    hang = "hang"
    crash = "crash"
    slow_link = "slow-link"
    pause = "pause"


class Abi(str, Enum):
    """Profiler ABI versions NCCL can use."""

    v4 = "v4"
    v5 = "v5"


class OnHang(str, Enum):
    """How a stalled run is ended."""

    abort = "abort"
    kill = "kill"


def _fault(
    scenario: Scenario,
    rank: int,
    slow_pct: float,
    from_step: int,
    step: int,
    op_index: int,
    link: str,
    factor: float,
    pause_s: float = 0.0,
    delay_ms: float = 0.0,
    phase: str | None = None,
    stage_ranks: list[int] | None = None,
) -> tuple[Fault, ...]:
    from comminsight.simulator.plan import Crash, Hang, Late, Pause, SlowLink, Straggler

    if scenario is Scenario.none:
        return ()
    if scenario is Scenario.pause:
        return (Pause(step, pause_s, op_index),)
    ranks = stage_ranks if stage_ranks is not None else [rank]
    if scenario is Scenario.straggler:
        return tuple(Straggler(r, slow_pct, from_step, phase or "") for r in ranks)
    if scenario is Scenario.late:
        return tuple(Late(r, delay_ms, from_step, phase or "backward") for r in ranks)
    if scenario is Scenario.hang:
        return (Hang(rank, step, op_index),)
    if scenario is Scenario.crash:
        return (Crash(rank, step, op_index),)
    try:
        first, second = (int(part) for part in link.split(","))
    except ValueError:
        raise typer.BadParameter("--link takes two global ranks as A,B (e.g. 0,2)", param_hint="--link") from None
    return (SlowLink((first, second), factor),)


def _stage_ranks(options: dict) -> list[int] | None:
    """Global ranks of pipeline stage ``--stage`` (megatron: rank = tp_rank + tp * (dp_rank + dp * stage))."""
    stage = options.pop("stage", -1)
    if stage is None or stage < 0:  # type: ignore[operator]
        return None
    if options["layout"] is not Layout.megatron or stage >= options["pp"]:  # type: ignore[operator]
        raise ValueError(f"--stage {stage} needs the megatron layout with more than {stage} pipeline stages")
    tp, pp = options["tp"], options["pp"]
    ranks = options["ranks"] or tp * pp * (options["dp"] or 1)  # type: ignore[operator]
    per_stage = ranks // pp  # type: ignore[operator]
    return list(range(stage * per_stage, (stage + 1) * per_stage))  # type: ignore[operator]


def _config(**options: object) -> SimulationConfig:
    from comminsight.simulator.plan import SimulationConfig

    stage_ranks = _stage_ranks(options)
    faults = _fault(
        options.pop("scenario"),  # type: ignore[arg-type]
        options.pop("rank"),  # type: ignore[arg-type]
        options.pop("slow_pct"),  # type: ignore[arg-type]
        options.pop("from_step"),  # type: ignore[arg-type]
        options.pop("step"),  # type: ignore[arg-type]
        options.pop("op_index"),  # type: ignore[arg-type]
        options.pop("link"),  # type: ignore[arg-type]
        options.pop("slow_factor"),  # type: ignore[arg-type]
        options.pop("pause_s", 0.0),  # type: ignore[arg-type]
        options.pop("delay_ms", 0.0),  # type: ignore[arg-type]
        options.pop("phase", None),  # type: ignore[arg-type]
        stage_ranks,
    )
    layout: Layout = options.pop("layout")  # type: ignore[assignment]
    ranks = options.pop("ranks")
    tp, pp, dp = options.pop("tp"), options.pop("pp"), options.pop("dp")
    if ranks is None:
        ranks = tp * pp * (dp or 1) if layout is Layout.megatron else 4  # type: ignore[operator]
    abi: Abi = options.pop("abi")  # type: ignore[assignment]
    on_hang: OnHang = options.pop("on_hang")  # type: ignore[assignment]
    return SimulationConfig(
        layout=layout.value,
        ranks=ranks,  # type: ignore[arg-type]
        tp=tp,  # type: ignore[arg-type]
        pp=pp,  # type: ignore[arg-type]
        dp=dp,  # type: ignore[arg-type]
        abi=int(abi.value[1:]),
        on_hang=on_hang.value,  # type: ignore[arg-type]
        faults=faults,
        **options,  # type: ignore[arg-type]
    )


_LAYOUT = typer.Option(Layout.ddp, "--layout", "-l", help="Parallel layout.")
_RANKS = typer.Option(None, "--ranks", "-n", min=1, help="World size (default 4; megatron: tp x pp x dp).")
_NODES = typer.Option(1, "--nodes", min=1, help="Simulated nodes (ranks split evenly; NODE_IP differs per node).")
_TP = typer.Option(1, "--tp", min=1, help="Tensor-parallel size (megatron).")
_PP = typer.Option(1, "--pp", min=1, help="Pipeline-parallel size (megatron).")
_DP = typer.Option(0, "--dp", min=0, help="Data-parallel size (megatron; 0: ranks / (tp x pp)).")
_STEPS = typer.Option(5, "--steps", min=1, help="Training steps.")
_STEP_MS = typer.Option(50.0, "--step-ms", min=0.001, help="Compute time per step in milliseconds.")
_JITTER = typer.Option(0.05, "--jitter", min=0.0, max=0.99, help="Random spread of compute phases (fraction).")
_SEED = typer.Option(0, "--seed", help="Seed of the jitter and transfer-time variation.")
_BUCKETS = typer.Option(4, "--buckets", min=1, help="DDP gradient buckets per step.")
_LAYERS = typer.Option(4, "--layers", min=1, help="FSDP layers; megatron layers per pipeline stage.")
_MICRO = typer.Option(0, "--micro-batches", min=0, help="Megatron micro-batches per step (0: 2 x pp).")
_ABI = typer.Option(Abi.v5, "--abi", help="Profiler ABI NCCL uses (v5: NCCL >= 2.28, v4: 2.27).")
_NAMES = typer.Option(True, "--comm-names/--no-comm-names", help="Give communicators names (off: commName NULL).")
_SCENARIO = typer.Option(Scenario.none, "--scenario", "-s", help="Fault to inject.")
_RANK = typer.Option(0, "--rank", "-r", min=0, help="Faulty rank (straggler, late, hang, crash).")
_STAGE = typer.Option(
    -1, "--stage", help="Straggler/late: every rank of this pipeline stage instead of --rank (megatron)."
)
_DELAY = typer.Option(20.0, "--delay-ms", min=0.0, help="Late: milliseconds the rank is late every step.")
_PHASE = typer.Option(
    None, "--phase", help="Straggler/late: only this compute phase (forward, backward, optimizer); late: backward."
)
_SLOW_PCT = typer.Option(50.0, "--slow-pct", help="Straggler: percent slower compute.")
_FROM_STEP = typer.Option(0, "--from-step", min=0, help="Straggler/late: first slow step.")
_STEP = typer.Option(1, "--step", min=0, help="Hang/crash: step in which the rank stops.")
_OP_INDEX = typer.Option(0, "--op-index", min=0, help="Hang/crash: launch index within that step it never issues.")
_LINK = typer.Option("0,1", "--link", help="Slow link: the two global ranks, A,B.")
_FACTOR = typer.Option(
    5.0,
    "--slow-factor",
    help="Slow link: how many times slower the transfers crossing it are (Send/Recv between A and B, "
    "and every collective whose ring has them as neighbours).",
)
_PAUSE = typer.Option(90.0, "--pause-s", min=0.0, help="Pause: seconds every rank pauses outside NCCL.")


@app.command("run")
def run_command(
    out: Path = typer.Option(..., "--home", "-o", help="Output home (COMMINSIGHT_HOME of every rank)."),
    plugin: Path | None = typer.Option(None, "--plugin", help="Profiler .so (default: the source-tree build)."),
    layout: Layout = _LAYOUT,
    ranks: int | None = _RANKS,
    nodes: int = _NODES,
    tp: int = _TP,
    pp: int = _PP,
    dp: int = _DP,
    steps: int = _STEPS,
    step_ms: float = _STEP_MS,
    jitter: float = _JITTER,
    seed: int = _SEED,
    buckets: int = _BUCKETS,
    layers: int = _LAYERS,
    micro_batches: int = _MICRO,
    abi: Abi = _ABI,
    comm_names: bool = _NAMES,
    scenario: Scenario = _SCENARIO,
    rank: int = _RANK,
    slow_pct: float = _SLOW_PCT,
    stage: int = _STAGE,
    delay_ms: float = _DELAY,
    phase: str | None = _PHASE,
    from_step: int = _FROM_STEP,
    step: int = _STEP,
    op_index: int = _OP_INDEX,
    link: str = _LINK,
    slow_factor: float = _FACTOR,
    pause_s: float = _PAUSE,
    hang_timeout: float = typer.Option(
        0.0, "--hang-timeout", min=0.0, help="Seconds without progress that end the run (0: auto)."
    ),
    on_hang: OnHang = typer.Option(
        OnHang.abort, "--on-hang", help="abort: ranks finalize their communicators; kill: SIGKILL."
    ),
    env: list[str] = typer.Option([], "--env", "-e", help="KEY=VALUE for every rank (plugin settings); repeatable."),
    agent: bool = typer.Option(False, "--agent/--no-agent", help="Let the plugin autostart the agent."),
    reuse_home: bool = typer.Option(False, "--reuse-home", help="Allow a home that already holds raw logs."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress display."),
) -> None:
    """Simulate a training job: N rank processes drive the plugin exactly as NCCL would."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from comminsight.simulator.plan import build_plan
    from comminsight.simulator.runner import default_plugin_path, run_simulation

    console = Console(stderr=True)

    try:
        config = _config(
            layout=layout, ranks=ranks, nodes=nodes, tp=tp, pp=pp, dp=dp, steps=steps, step_ms=step_ms,
            jitter=jitter, seed=seed, buckets=buckets, layers=layers, micro_batches=micro_batches, abi=abi,
            comm_names=comm_names, scenario=scenario, rank=rank, slow_pct=slow_pct, from_step=from_step, step=step,
            op_index=op_index, link=link, slow_factor=slow_factor, hang_timeout_s=hang_timeout, on_hang=on_hang,
            pause_s=pause_s, stage=stage, delay_ms=delay_ms, phase=phase,
        )  # fmt: skip
        build_plan(config)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    extra = {}
    for item in env:
        key, sep, value = item.partition("=")
        if not sep or not key or not key.replace("_", "").isalnum():
            raise typer.BadParameter(f"expected KEY=VALUE, got {item!r}", param_hint="--env")
        extra[key] = value
    if agent:
        extra.setdefault("COMMINSIGHT_AGENT_AUTOSTART", "1")
    plugin_path = plugin or default_plugin_path()
    if plugin_path is None or not plugin_path.is_file():
        if plugin is not None:
            fail(f"profiler plugin {plugin} does not exist")
        fail("no profiler plugin found: build it with `make -C native/profiler` or pass --plugin")

    total = config.ranks * config.steps
    with Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=console,
        disable=quiet,
        transient=False,
    ) as progress:
        task = progress.add_task(f"{config.layout} x{config.ranks}", total=total, status="starting")

        def show(snapshot) -> None:  # type: ignore[no-untyped-def]
            counts = Counter(s.name.lower() for s in snapshot.statuses)
            status = ", ".join(f"{n} {name}" for name, n in sorted(counts.items()))
            if snapshot.ended_by:
                status += f" — ending ({snapshot.ended_by})"
            progress.update(task, completed=sum(snapshot.steps_done), status=status)

        try:
            result = run_simulation(
                config, plugin_path, out, env=extra, on_progress=None if quiet else show, reuse_home=reuse_home
            )
        except FileExistsError as error:
            progress.stop()
            fail(f"{error} (pass --reuse-home to mix runs)")
        truth = result.ground_truth
        progress.update(task, completed=sum(r["steps_completed"] for r in truth["ranks"]), status="finished")

    outcomes = Counter(r["outcome"] for r in truth["ranks"])
    console.print(f"Ranks: {', '.join(f'{n} {o}' for o, n in sorted(outcomes.items()))}; wall {result.wall_s:.1f} s")
    if result.ended_by:
        console.print(f"The run stalled and was ended by [bold]{result.ended_by}[/].")
    console.print(f"Raw logs:     {result.home / 'inspector_logs'}")
    console.print(f"Ground truth: {result.ground_truth_path}")
    typer.echo(str(result.ground_truth_path))
    failed = [r["rank"] for r in truth["ranks"] if r["outcome"] == "failed"]
    if failed:
        fail(f"ranks {failed} failed; see {result.home / 'simulator'}/rank-*.log", code=1)


@app.command("plan")
def plan_command(
    layout: Layout = _LAYOUT,
    ranks: int | None = _RANKS,
    nodes: int = _NODES,
    tp: int = _TP,
    pp: int = _PP,
    dp: int = _DP,
    steps: int = _STEPS,
    buckets: int = _BUCKETS,
    layers: int = _LAYERS,
    micro_batches: int = _MICRO,
) -> None:
    """Print the communicators and per-rank launches a configuration would simulate; starts nothing."""
    from rich.console import Console
    from rich.table import Table

    from comminsight.simulator.plan import Launch, build_plan

    try:
        config = _config(
            layout=layout, ranks=ranks, nodes=nodes, tp=tp, pp=pp, dp=dp, steps=steps, step_ms=1.0, jitter=0.0,
            seed=0, buckets=buckets, layers=layers, micro_batches=micro_batches, abi=Abi.v5, comm_names=True,
            scenario=Scenario.none, rank=0, slow_pct=0.0, from_step=0, step=0, op_index=0, link="0,1",
            slow_factor=1.0, hang_timeout_s=0.0, on_hang=OnHang.abort,
        )  # fmt: skip
        plan = build_plan(config)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    out = Console()
    comms = Table(title="Communicators")
    for column in ("name", "comm_hash", "nranks", "nnodes", "ranks"):
        comms.add_column(column)
    for comm in plan.communicators:
        members = ",".join(map(str, comm.ranks))
        comms.add_row(comm.name, f"{comm.comm_hash:#018x}", str(comm.nranks), str(comm.nnodes), members[:60])
    out.print(comms)
    ranks_table = Table(title="Per rank, step 0")
    for column in ("rank", "coordinates", "launches", "operations"):
        ranks_table.add_column(column)
    for schedule in plan.schedules[:64]:
        launches = [a for a in schedule.steps[0] if isinstance(a, Launch)]
        funcs = Counter(op.func for launch in launches for op in launch.ops)
        ranks_table.add_row(
            str(schedule.rank),
            str(plan.coordinates[schedule.rank]),
            str(len(launches)),
            ", ".join(f"{n} {f}" for f, n in sorted(funcs.items())),
        )
    out.print(ranks_table)
