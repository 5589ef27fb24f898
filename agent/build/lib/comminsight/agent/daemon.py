"""The agent daemon: single instance per home, one ingest loop, an HTTP thread and a delivery thread.

Loop (every poll interval): discover rings, consume them, tail segments of writers without a ring,
re-evaluate hangs (new suspicions are written to ``<home>/hang_detection/`` and pushed at once),
checkpoint when due, seal when due, report live state when due. SIGTERM/SIGINT: stop the loop,
consume what is left, checkpoint, seal a final archive, give delivery a bounded time, exit 0.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from comminsight.agent import AGENT_VERSION
from comminsight.agent.archiver import Archiver
from comminsight.agent.cluster import ClusterView
from comminsight.agent.config import AgentConfig
from comminsight.agent.ingest import Ingest, atomic_write_json
from comminsight.agent.providers import build_providers
from comminsight.agent.segments import pid_alive
from comminsight.agent.server import AgentServer
from comminsight.agent.spool import Spool
from comminsight.agent.state import LiveState
from comminsight.agent.uploader import LiveReporter

log = logging.getLogger("comminsight.agent")
FINAL_DELIVERY_S = 10.0


class AlreadyRunning(RuntimeError):
    """Another agent holds this home's lock."""


class InstanceLock:
    """``flock`` on ``<home>/agent.lock``, shared with the profiler's autostart; the file holds the owner's pid.

    When the profiler starts the agent it takes the lock first and passes the locked descriptor in
    ``COMMINSIGHT_AGENT_LOCK_FD``; we adopt it if it really is that file, so there is no window in
    which a second agent could start.
    """

    def __init__(self, path: Path, inherited_fd: str | None = None) -> None:
        self.path = path
        self.fd: int | None = None
        self.inherited_fd = inherited_fd

    def _adopt(self) -> int | None:
        if not self.inherited_fd or not self.inherited_fd.isdigit():
            return None
        fd = int(self.inherited_fd)
        try:
            inherited, on_disk = os.fstat(fd), os.stat(self.path)
        except OSError:
            return None
        if (inherited.st_dev, inherited.st_ino) != (on_disk.st_dev, on_disk.st_ino):
            return None
        return fd

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = self._adopt()
        if fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        else:
            os.set_inheritable(fd, False)
        try:
            # On an adopted descriptor this succeeds at once: the lock belongs to its open file description.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            raise AlreadyRunning(f"an agent (pid {owner or '?'}) already runs for this home ({self.path})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


class Agent:
    def __init__(self, config: AgentConfig, proc_root: Path = Path("/proc")) -> None:
        self.config = config
        self.started = time.time()
        self.stop_event = threading.Event()
        for d in (config.shms_dir, config.logs_dir, config.hang_dir, config.spool_dir, config.state_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.state = LiveState(config.hang_threshold, config.hang_floor, config.hang_factor)
        self.ingest = Ingest(
            config.shms_dir, config.logs_dir, config.state_dir, self.state, config.batch_records, proc_root
        )
        self.spool = Spool(
            config.spool_dir,
            build_providers(config),
            config.spool_max_bytes,
            config.spool_max_age,
            config.backoff_initial,
            config.backoff_max,
        )
        self.archiver = Archiver(
            config.logs_dir,
            config.hang_dir,
            config.state_dir,
            self.spool,
            workload_id=config.workload_id,
            node=config.node,
            host=config.host,
            node_ip=config.node_ip,
            orphan_grace_s=config.orphan_grace,
            proc_root=proc_root,
        )
        self.reporter = LiveReporter(config)
        self.cluster = ClusterView()
        self.server: AgentServer | None = None
        self.last_loop = time.monotonic()
        self.last_checkpoint_ns = 0
        self.checkpoint_error = ""
        self.hang_history: list[dict[str, Any]] = []
        self._dropped_seen: dict[str, int] = {}

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self.archiver.recover()
        self.ingest.restore()
        self.server = AgentServer(self, self.config.listen_host, self.config.listen_port)
        self.server.start()
        self.spool.start(idle_s=max(1.0, self.config.poll_interval * 5))
        log.info(
            "agent %s serving on %s:%d (home %s, workload %r, node %s, mode %s, providers %s)",
            AGENT_VERSION,
            *self.server.address,
            self.config.home,
            self.config.workload_id,
            self.config.node,
            self.config.mode,
            ",".join(self.spool.providers) or "none",
        )

    def run_loop(self) -> None:
        cfg = self.config
        next_checkpoint = time.monotonic() + cfg.checkpoint_interval
        next_seal = time.monotonic() + cfg.archive_interval
        next_live = time.monotonic() + cfg.live_interval
        next_discover = 0.0
        while not self.stop_event.is_set():
            now = time.monotonic()
            self.last_loop = now
            try:
                if now >= next_discover:
                    self.ingest.discover_rings()
                    next_discover = now + min(1.0, cfg.poll_interval * 5)
                self.step()
                if now >= next_checkpoint:
                    self.checkpoint()
                    next_checkpoint = now + cfg.checkpoint_interval
                if now >= next_seal:
                    self.seal()
                    next_seal = now + cfg.archive_interval
                if now >= next_live:
                    self.report_live()
                    next_live = now + cfg.live_interval
            except Exception:
                log.exception("agent loop iteration failed; continuing")
            self.stop_event.wait(cfg.poll_interval)

    def step(self) -> None:
        self.ingest.poll_rings()
        self.ingest.tail_segments()
        self._track_drops()
        _, new = self.state.detect_hangs()
        if new:
            self.on_hang(new)

    def _track_drops(self) -> None:
        for kind, table in (("ring", self.ingest.counters.ring_dropped), ("lost", self.ingest.counters.ring_lost)):
            for name, value in table.items():
                key = f"{kind}:{name}"
                delta = value - self._dropped_seen.get(key, 0)
                if delta > 0:
                    self.archiver.dropped_since_seal[kind] += delta
                    log.warning(
                        "ring %s: %d records %s",
                        name,
                        delta,
                        "dropped (ring full)" if kind == "ring" else "lost before the ring",
                    )
                self._dropped_seen[key] = value

    def checkpoint(self) -> None:
        try:
            self.ingest.checkpoint()
            self.last_checkpoint_ns = time.time_ns()
            self.checkpoint_error = ""
        except OSError as exc:
            self.checkpoint_error = str(exc)
            log.error("checkpoint failed: %s (ring tails not published, nothing lost)", exc)

    def seal(self, final: bool = False) -> None:
        self.ingest.tail_segments()  # live state sees a segment's records before the seal removes it
        try:
            self.archiver.seal(final=final)
        except OSError as exc:
            log.error("seal failed: %s (inputs kept for the next seal)", exc)
        for base in list(self.ingest.segment_offsets):
            if not (self.config.logs_dir / base).exists() and not (self.config.logs_dir / f"{base}.sealed").exists():
                self.ingest.forget_segment(base)

    def shutdown(self) -> None:
        log.info("shutting down: final consume, checkpoint and seal")
        try:
            self.ingest.discover_rings()
            self.step()
            self.checkpoint()
            self.seal(final=True)
            self.report_live(final=True)
        except Exception:
            log.exception("final seal failed")
        deadline = time.monotonic() + FINAL_DELIVERY_S
        self.spool.stop(timeout=FINAL_DELIVERY_S)
        while time.monotonic() < deadline and self.spool.archives():
            if self.spool.deliver_once() == 0:
                break
        if self.server:
            self.server.stop()
        self.ingest.close()

    # ---- hang ----------------------------------------------------------------------------------
    def on_hang(self, suspicions: list[dict[str, Any]]) -> None:
        evidence = {
            "kind": "comminsight.hang",
            "schema_version": 1,
            "source": "agent",
            "workload_id": self.config.workload_id,
            "node": self.config.node,
            "host": self.config.host,
            "detected_ns": time.time_ns(),
            "suspicions": suspicions,
        }
        for s in suspicions:
            log.error(
                "hang suspected on %s (%s): %s seq %d in flight %.1fs > %.1fs; never entered: %s",
                s["comm_hash"],
                s["comm_name"] or "-",
                s["op"],
                s["seq"],
                s["oldest_age_s"],
                s["threshold_s"],
                s["never_entered"] or "none seen",
            )
        name = f"agent-hang-{evidence['detected_ns']}.json"
        try:
            atomic_write_json(self.config.hang_dir / name, evidence)
        except OSError as exc:
            log.error("cannot write hang evidence %s: %s", name, exc)
        self.hang_history = [*self.hang_history, evidence][-50:]
        self.report_live()  # at once, not at the next live interval

    def hang_view(self) -> dict[str, Any]:
        current = list(self.state.suspicions.values())
        if self.config.mode == "master" and self.cluster.reports:
            _, current = self.cluster.merge(self.config.node, self.state.communicators_view(), current)
        return {"hang": bool(current), "suspicions": current, "history": self.hang_history[-10:]}

    # ---- views ---------------------------------------------------------------------------------
    def lag_seconds(self) -> float:
        newest = self.state.newest_record_ns
        return max(0.0, (time.time_ns() - newest) / 1e9) if newest and self.ingest.counters.lag_records else 0.0

    def communicators(self) -> list[dict[str, Any]]:
        local = self.state.communicators_view()
        for c in local:
            c["node"] = self.config.node
        return local

    def cluster_view_json(self) -> dict[str, Any]:
        comms, hangs = self.cluster.merge(self.config.node, self.communicators(), list(self.state.suspicions.values()))
        return {"mode": self.config.mode, "nodes": self.cluster.nodes(), "communicators": comms, "hang": hangs}

    def live_payload(self) -> dict[str, Any]:
        comms = self.communicators()
        hangs = list(self.state.suspicions.values())
        if self.config.mode == "master":
            comms, hangs = self.cluster.merge(self.config.node, comms, hangs)
        ranks = sorted(
            {
                int(p["global_rank"])
                for c in comms
                for p in c["ranks"].values()
                if isinstance(p, dict) and int(p.get("global_rank", -1)) >= 0
            }
        )
        return {
            "workload_id": self.config.workload_id,
            "node": self.config.node,
            "host": self.config.host,
            "advertise_url": self.config.advertise_url,
            "agent_version": AGENT_VERSION,
            "sent_ns": time.time_ns(),
            "ranks": ranks,
            "communicators": comms,
            "hang": hangs or None,
        }

    def report_live(self, final: bool = False) -> None:
        if self.reporter.target:
            payload = self.live_payload()
            if self.config.mode == "slave":
                payload["hang"] = payload["hang"] or []
            payload["finished"] = final and not self._writers_alive()
            self.reporter.post(payload)

    def _writers_alive(self) -> bool:
        """Whether any writer process of a ring on this node still runs (the job is not finished)."""
        for ring in self.ingest.rings.values():
            if not ring.reader.counters()["writer_closed"] and pid_alive(
                ring.reader.info.writer_pid, self.ingest.proc_root
            ):
                return True
        return False

    def health(self) -> dict[str, Any]:
        problems = []
        stalled = time.monotonic() - self.last_loop > max(30.0, 20 * self.config.poll_interval)
        if stalled:
            problems.append("ingest loop has not run for over 30 s")
        if self.checkpoint_error:
            problems.append(f"checkpoint failing: {self.checkpoint_error}")
        bad = sorted(self.ingest.bad_files)
        if bad:
            problems.append(f"malformed inputs skipped: {', '.join(bad[:10])}")
        dropped = sum(self.ingest.counters.ring_dropped.values())
        if dropped:
            problems.append(f"rings dropped {dropped} records (agent too slow or was absent)")
        for provider, error in self.spool.stats.last_error.items():
            problems.append(f"delivery to {provider} failing: {error}")
        _, spool_bytes, _ = self.spool.usage()
        if spool_bytes > 0.8 * self.config.spool_max_bytes:
            problems.append(f"spool at {spool_bytes} of {self.config.spool_max_bytes} bytes")
        if self.spool.stats.dropped_archives:
            problems.append(f"spool dropped {self.spool.stats.dropped_archives} archives")
        if self.state.suspicions:
            problems.append(f"{len(self.state.suspicions)} hang suspicion(s): see /api/v1/hang")
        if not self.spool.providers:
            problems.append("no archive provider configured")
        status = "stalled" if stalled else "degraded" if problems else "ok"
        return {
            "status": status,
            "problems": problems,
            "rings": len(self.ingest.rings),
            "records": self.state.records_applied,
        }

    def status(self) -> dict[str, Any]:
        rings = []
        for name, ring in sorted(self.ingest.rings.items()):
            r = ring.reader
            counters = r.counters()
            rings.append(
                {
                    "name": name,
                    "writer_pid": r.info.writer_pid,
                    "capacity": r.capacity,
                    "host": r.info.host,
                    "cursor": r.cursor,
                    "head": counters["head"],
                    "pending": r.pending,
                    "dropped": counters["dropped"],
                    "lost": counters["lost"],
                    "writer_closed": bool(counters["writer_closed"]),
                }
            )
        n_archives, spool_bytes, spool_age = self.spool.usage()
        a = self.archiver.stats
        return {
            "agent_version": AGENT_VERSION,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started, 3),
            "home": str(self.config.home),
            "workload_id": self.config.workload_id,
            "node": self.config.node,
            "host": self.config.host,
            "mode": self.config.mode,
            "health": self.health(),
            "records_applied": self.state.records_applied,
            "corrupt_records": self.ingest.counters.corrupt_records,
            "lag_records": self.ingest.counters.lag_records,
            "rings": rings,
            "tailed_segments": len(self.ingest.segment_offsets),
            "communicators": len(self.state.comms),
            "inflight": len(self.state.inflight),
            "hang_suspicions": len(self.state.suspicions),
            "archives": {
                "sealed": a.archives,
                "records": a.records,
                "segments": a.segments,
                "quarantined": a.quarantined,
                "orphans_sealed": a.orphans_sealed,
                "last_archive": a.last_archive,
                "last_seal_ns": a.last_seal_ns,
            },
            "spool": {
                "archives": n_archives,
                "bytes": spool_bytes,
                "oldest_age_s": round(spool_age, 3),
                "dropped_archives": self.spool.stats.dropped_archives,
                "dropped_records": self.spool.stats.dropped_records,
            },
            "providers": {
                name: {
                    "delivered": self.spool.stats.delivered.get(name, 0),
                    "failures": self.spool.stats.failures.get(name, 0),
                    "last_error": self.spool.stats.last_error.get(name, ""),
                }
                for name in self.spool.providers
            },
            "last_checkpoint_ns": self.last_checkpoint_ns,
            "cluster_nodes": len(self.cluster.reports),
        }


def run(config: AgentConfig, proc_root: Path = Path("/proc")) -> int:
    """Run the agent until SIGTERM/SIGINT; returns the process exit code."""
    for warning in config.warnings:
        log.warning("config: %s", warning)
    lock = InstanceLock(config.lock_path, os.environ.get("COMMINSIGHT_AGENT_LOCK_FD"))
    try:
        lock.acquire()
    except AlreadyRunning as exc:
        log.error("%s", exc)
        return 3
    agent = Agent(config, proc_root)

    def stop(signum: int, _frame: Any) -> None:
        log.info("received %s", signal.Signals(signum).name)
        agent.stop_event.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        agent.start()
        (config.state_dir / "agent.json").write_text(
            json.dumps({"pid": os.getpid(), "listen": "{}:{}".format(*agent.server.address) if agent.server else ""})
        )
        agent.run_loop()
    except OSError as exc:
        log.error("agent cannot start: %s", exc)
        return 2
    finally:
        agent.shutdown()
        lock.release()
    log.info("agent stopped cleanly")
    return 0
