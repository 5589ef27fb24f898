"""``comminsight agent``: run the node agent, show its effective configuration, summarise its state."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import typer

from comminsight.cli.errors import OneLineErrors, fail

app = typer.Typer(help="Run and inspect the node agent.", no_args_is_help=True, cls=OneLineErrors)


@app.command("run")
def run_command(
    home: Path | None = typer.Option(None, help="Runtime home (default: $COMMINSIGHT_HOME or /opt/comminsight)"),
) -> None:
    """Run the agent daemon in the foreground until SIGTERM (clean shutdown with a final seal)."""
    from logging.handlers import RotatingFileHandler

    from comminsight.agent.config import load_config
    from comminsight.agent.daemon import run

    config = load_config(home=home)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    try:
        # When the profiler autostarts us, stdio is /dev/null: the log file is where the lines go.
        (config.home / "logs").mkdir(parents=True, exist_ok=True)
        handlers.append(RotatingFileHandler(config.home / "logs" / "agent.log", maxBytes=16 << 20, backupCount=3))
    except OSError as exc:
        print(f"warning: cannot write {config.home / 'logs' / 'agent.log'}: {exc}", file=sys.stderr)
    logging.basicConfig(
        level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", handlers=handlers
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise in the agent's log
    raise typer.Exit(run(config))


@app.command("config")
def config_command(
    home: Path | None = typer.Option(None, help="Runtime home"),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output"),
) -> None:
    """Print the effective configuration and where each value came from (env, file, default)."""
    from comminsight.agent.config import load_config

    config = load_config(home=home)
    rows = config.describe()
    if as_json:
        typer.echo(json.dumps({k: {"value": v, "source": s} for k, v, s, _ in rows}, indent=1))
    else:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"comminsight agent configuration (home {config.home})")
        for column in ("key", "value", "source", "meaning"):
            table.add_column(column)
        for key, value, source, doc in rows:
            table.add_row(key, value, source, doc)
        Console().print(table)
    for warning in config.warnings:
        typer.echo(f"warning: {warning}", err=True)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.1f}s" if seconds < 120 else f"{seconds / 60:.1f}min"


@app.command("status")
def status_command(
    home: Path | None = typer.Option(None, help="Runtime home"),
    url: str | None = typer.Option(None, help="Agent URL (default: from COMMINSIGHT_AGENT_LISTEN)"),
    as_json: bool = typer.Option(False, "--json", help="Print the raw API answers"),
) -> None:
    """Summarise the local agent's state (talks to its HTTP API)."""
    from comminsight.agent.config import load_config

    config = load_config(home=home)
    base = (url or f"http://{config.listen}").rstrip("/")
    import httpx
    from rich.console import Console
    from rich.table import Table

    console = Console()
    try:
        with httpx.Client(timeout=5.0) as client:
            status = client.get(base + "/api/v1/status").json()
            comms = client.get(base + "/api/v1/communicators").json()["communicators"]
            hang = client.get(base + "/api/v1/hang").json()
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        fail(f"no agent answering at {base}: {exc}", code=1)
    if as_json:
        typer.echo(json.dumps({"status": status, "communicators": comms, "hang": hang}, indent=1))
        return
    health = status["health"]
    colour = {"ok": "green", "degraded": "yellow"}.get(health["status"], "red")
    console.print(
        f"[bold]agent[/bold] pid {status['pid']} up {_age(status['uptime_s'])}  workload {status['workload_id']!r}"
        f"  node {status['node']}  mode {status['mode']}  health [{colour}]{health['status']}[/{colour}]"
    )
    for problem in health["problems"]:
        console.print(f"  [yellow]![/yellow] {problem}")
    spool = status["spool"]
    console.print(
        f"records {status['records_applied']} (corrupt {status['corrupt_records']}, lag {status['lag_records']})  "
        f"rings {len(status['rings'])}  archives sealed {status['archives']['sealed']}  "
        f"spool {spool['archives']} archives / {spool['bytes']} B (oldest {_age(spool['oldest_age_s'])})"
    )
    table = Table(title="communicators")
    for column in ("comm", "name", "ranks", "ops", "last seq", "lagging", "in flight"):
        table.add_column(column)
    for c in comms:
        table.add_row(
            c["comm_hash"],
            c["comm_name"] or "-",
            f"{len(c['ranks'])}/{c['nranks']}",
            str(sum(o["count"] for o in c["ops"].values())),
            str(c["last_completed_seq"]),
            ",".join(map(str, c["lagging_ranks"])) or "-",
            str(c["inflight"]),
        )
    console.print(table)
    if hang["hang"]:
        for s in hang["suspicions"]:
            console.print(
                f"[red bold]HANG[/red bold] {s['comm_hash']} ({s['comm_name'] or '-'}) {s['op']} seq {s['seq']}: "
                f"in flight {_age(s['oldest_age_s'])} (threshold {_age(s['threshold_s'])}); "
                f"never entered: {s['never_entered'] or 'none seen'}"
            )
    else:
        console.print("[green]no hang suspected[/green]")
