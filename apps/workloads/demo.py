"""The demo job: a simulated Megatron run that a real node agent uploads to this site while it runs.

What a new user sees on an empty site, started from the workload list ("Run a demo job") or from a shell
(``manage.py demo``). Nothing here is staged: the simulator (``comminsight.simulator``) drives the real
profiler plugin in one process per rank exactly as NCCL would; the real agent (``comminsight agent run``)
reads the plugin's rings and logs, reports live progress and uploads sealed archives to this site with an
agent token created for the run (revoked when it ends). The job is TP 2 x PP 2 x DP 4 = 16 ranks on one
node; one rank becomes a straggler part-way through, and later another rank stops issuing its next
operation, so the workload turns from running to hung. When the job has been aborted and every archive is
ingested, the analyses are queued, so their results are ready when the user opens them.

Everything the run writes lives under ``<data dir>/demo/<workload id>/`` (the agent's home and its log).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.db import connections
from django.utils import timezone

from apps.accounts.models import User
from apps.accounts.services import agent_token_create, agent_token_revoke
from comminsight import lifeline

from .models import Archive, ArchiveState, Workload

logger = logging.getLogger(__name__)

DEMO_TP, DEMO_PP, DEMO_DP = 2, 2, 4
DEMO_NODE_IP = "10.0.0.1"  # what the simulator gives the ranks of its first node
DEMO_ANALYSES = ("hang", "stragglers", "steps", "perf")


class DemoError(Exception):
    """The demo cannot start (plugin not built, another demo running, site not reachable); says why."""


@dataclass(frozen=True)
class DemoPlan:
    """Timing of the demo job. The defaults give about a minute: watchable, and long enough to look at."""

    steps: int = 40
    step_ms: float = 300.0
    straggler_rank: int = 6
    straggler_slow_pct: float = 80.0
    straggler_from_step: int = 5
    hang_rank: int = 5
    hang_step: int = 30
    hang_s: float = 25.0  # how long the job stays hung before the launcher aborts it
    agent_hang_floor_s: float = 3.0  # the agent calls an operation hung after this long (at least)
    archive_interval_s: float = 4.0  # archives reach the site while the job runs

    def __post_init__(self) -> None:
        if not 2 <= self.steps <= 10_000:
            raise DemoError("steps must be between 2 and 10000")
        if not 0 <= self.straggler_from_step < self.hang_step < self.steps:
            raise DemoError("the straggler must start before the hang, and the hang before the last step")
        if self.step_ms <= 0 or self.hang_s <= 0:
            raise DemoError("step time and hang time must be positive")


@dataclass
class DemoOutcome:
    workload: Workload
    ranks_ended: str  # how the simulator ended the job ("abort" after the hang)
    archives: int
    log_path: Path


def demo_external_id() -> str:
    return "demo-megatron-" + timezone.now().strftime("%Y%m%d-%H%M%S")


def demo_workload_create(*, owner: User) -> Workload:
    """The workload row the agent's first report will land in, so a page can link to it at once."""
    external_id = demo_external_id()
    suffix = 1
    while Workload.objects.filter(owner=owner, external_id=external_id).exists():
        suffix += 1
        external_id = f"{demo_external_id()}-{suffix}"
    return Workload.objects.create(
        owner=owner,
        external_id=external_id,
        name=f"Demo: Megatron TP{DEMO_TP} x PP{DEMO_PP} x DP{DEMO_DP}",
    )


def demo_directory(workload: Workload) -> Path:
    return Path(settings.DATA_DIR) / "demo" / workload.external_id


def demo_agent_server_url(page_url: str) -> str:
    """Where the agent uploads: the agents' own listener when the site has one, else the URL the user used."""
    if settings.SERVER_AGENT_LISTEN:
        return "http://" + settings.SERVER_AGENT_LISTEN
    return page_url.rstrip("/")


def _plugin_path() -> Path:
    from comminsight.simulator.runner import default_plugin_path

    plugin = default_plugin_path()
    if plugin is None or not plugin.is_file():
        raise DemoError("the profiler plugin is not built: run `make profiler` (or `make run`) first")
    return plugin


def _agent_command() -> list[str]:
    script = Path(sys.executable).parent / "comminsight"
    if script.is_file():
        return [str(script), "agent", "run"]
    return [sys.executable, "-c", "from comminsight.cli import main; main()", "agent", "run"]


def _agent_environment(*, home: Path, server_url: str, secret: str, workload: Workload, plan: DemoPlan) -> dict:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("COMMINSIGHT_")}
    environment.update(
        {
            "COMMINSIGHT_HOME": str(home),
            "COMMINSIGHT_AGENT_LISTEN": "127.0.0.1:0",  # never collide with a real agent on 19102
            "COMMINSIGHT_AGENT_SERVER_URL": server_url,
            "COMMINSIGHT_AGENT_TOKEN": secret,
            "COMMINSIGHT_WORKLOAD_ID": workload.external_id,
            "COMMINSIGHT_ARCHIVE_INTERVAL": str(plan.archive_interval_s),
            "COMMINSIGHT_AGENT_LIVE_INTERVAL": "1",
            "COMMINSIGHT_AGENT_HANG_FLOOR": str(plan.agent_hang_floor_s),
            "COMMINSIGHT_AGENT_ORPHAN_GRACE": "1",
            "COMMINSIGHT_AGENT_BACKOFF_INITIAL": "0.5",
            "COMMINSIGHT_AGENT_BACKOFF_MAX": "5",
            "NODE_IP": DEMO_NODE_IP,
        }
    )
    return lifeline.child_environment(environment)  # the agent stops (final seal) when this process ends


def _wait(condition: Callable[[], bool], timeout_s: float, interval_s: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval_s)
    return condition()


def _nothing_left_to_upload(home: Path) -> bool:
    logs = home / "inspector_logs"
    spool = home / "spool"
    pending_logs = logs.is_dir() and any(p.is_file() for p in logs.iterdir())
    pending_archives = spool.is_dir() and any(spool.glob("*.tar.zst"))
    return not pending_logs and not pending_archives


def demo_run(
    *,
    workload: Workload,
    page_url: str,
    plan: DemoPlan | None = None,
    say: Callable[[str], None] = logger.info,
    analyse: bool = True,
) -> DemoOutcome:
    """Run the demo job into ``workload`` (blocks for the job's duration). The site must be serving ``page_url``."""
    from comminsight.simulator.plan import Hang, SimulationConfig, Straggler
    from comminsight.simulator.runner import run_simulation

    plan = plan or DemoPlan()
    plugin = _plugin_path()
    server_url = demo_agent_server_url(page_url)
    directory = demo_directory(workload)
    if directory.exists():
        shutil.rmtree(directory)
    home = directory / "home"
    home.mkdir(parents=True)
    log_path = directory / "agent.log"
    issued = agent_token_create(owner=workload.owner, name=f"demo {workload.external_id}"[:100])
    say(f"Agent token {issued.token.name!r} created for {workload.owner.username}; agent uploads to {server_url}")
    config = SimulationConfig(
        layout="megatron",
        ranks=DEMO_TP * DEMO_PP * DEMO_DP,
        tp=DEMO_TP,
        pp=DEMO_PP,
        dp=DEMO_DP,
        steps=plan.steps,
        step_ms=plan.step_ms,
        faults=(
            Straggler(rank=plan.straggler_rank, slow_pct=plan.straggler_slow_pct, from_step=plan.straggler_from_step),
            Hang(rank=plan.hang_rank, step=plan.hang_step),
        ),
        hang_timeout_s=plan.hang_s,
    )
    with open(log_path, "wb") as log:
        agent = subprocess.Popen(
            _agent_command(),
            env=_agent_environment(
                home=home, server_url=server_url, secret=issued.secret, workload=workload, plan=plan
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        say(
            f"Simulating {config.ranks} ranks (TP {DEMO_TP} x PP {DEMO_PP} x DP {DEMO_DP}), {plan.steps} steps: "
            f"rank {plan.straggler_rank} straggles from step {plan.straggler_from_step}, "
            f"rank {plan.hang_rank} hangs in step {plan.hang_step}"
        )
        result = run_simulation(config, plugin, home, env={"COMMINSIGHT_AGENT_AUTOSTART": "0"})
        say(f"The job ended ({result.ended_by or 'completed'}); the agent uploads what is left")
        if agent.poll() is not None:
            raise DemoError(f"the agent stopped early (exit {agent.returncode}); see {log_path}")
        if not _wait(lambda: _nothing_left_to_upload(home), timeout_s=180):
            say(f"Some archives were not delivered within 3 minutes; see {log_path}")
    finally:
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)  # the agent seals, uploads and sends its last report
            try:
                agent.wait(60)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
        agent_token_revoke(actor=workload.owner, token=issued.token)
    # With a Celery worker, ingest runs after the upload answered: wait for it before analysing.
    _wait(lambda: not Archive.objects.filter(workload=workload, state=ArchiveState.STORED).exists(), timeout_s=180)
    archives = Archive.objects.filter(workload=workload, state=ArchiveState.INGESTED).count()
    say(f"{archives} archives ingested into workload {workload.pk}")
    if analyse and archives:
        from apps.analysis.services import analysis_request

        workload.refresh_from_db()
        for kind in DEMO_ANALYSES:
            analysis_request(workload, kind, workload.owner)
        say("Analyses queued: " + ", ".join(DEMO_ANALYSES))
    return DemoOutcome(workload, result.ended_by or "completed", archives, log_path)


# --- started from a page: one demo at a time per server process, in a thread of its own ---------------------------

_running = threading.Lock()


def demo_running() -> bool:
    """Whether this server process is running a demo job now."""
    if _running.acquire(blocking=False):
        _running.release()
        return False
    return True


def demo_start_in_background(*, owner: User, page_url: str, plan: DemoPlan | None = None) -> Workload:
    """Create the demo workload and run the job in a background thread; raises DemoError when it cannot start.

    The plan is ``plan``, else the ``DEMO_PLAN`` setting (a dict of DemoPlan fields, for a shorter or longer
    demo), else the defaults.
    """
    plan = plan or DemoPlan(**getattr(settings, "DEMO_PLAN", {}))
    _plugin_path()
    if not _running.acquire(blocking=False):
        raise DemoError("A demo job is already running; wait for it to end.")
    try:
        workload = demo_workload_create(owner=owner)
    except BaseException:
        _running.release()
        raise

    def run() -> None:
        try:
            demo_run(workload=workload, page_url=page_url, plan=plan)
        except Exception:
            logger.exception("the demo job of workload %s failed", workload.pk)
        finally:
            connections.close_all()  # this thread's own connection
            _running.release()

    threading.Thread(target=run, name=f"demo-{workload.pk}", daemon=True).start()
    return workload
