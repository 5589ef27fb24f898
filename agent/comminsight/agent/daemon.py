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

from comminsight import lifeline
from comminsight.agent import AGENT_VERSION
from comminsight.agent.archiver import Archiver
from comminsight.agent.cluster import ClusterView
from comminsight.agent.config import AgentConfig
from comminsight.agent.diagnosis import SENT_EVIDENCE_RECORDS, NodeEvidence, diagnose
from comminsight.agent.ingest import Ingest, atomic_write_json
from comminsight.agent.providers import build_providers
from comminsight.agent.samplers import Samplers
from comminsight.agent.server import AgentServer
from comminsight.agent.spool import Spool
from comminsight.agent.state import LiveState
from comminsight.agent.steps import LiveSteps
from comminsight.agent.uploader import LiveReporter
from comminsight.evidence.process_groups import FILE_NAME as TABLE_NAME
from comminsight.evidence.process_groups import load_tables, name_communicators, naming_summary
from comminsight.formats.archive import ArchiveMember

log = logging.getLogger("comminsight.agent")
FINAL_DELIVERY_S = 10.0
SEAL_ACK_WAIT_S = 2.0  # how long a seal waits for the writers to seal their open segments on request
DIAGNOSIS_INTERVAL_S = 2.0  # re-run the live chain analysis at most this often while a hang is suspected
HEARTBEAT_EVIDENCE_RECORDS = 1536  # diagnosis records in one heartbeat to the site, all nodes (~520 KiB of JSON)


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
        self.state = LiveState(config.hang_threshold, config.hang_floor, config.hang_factor, config.hang_cold)
        self.steps = LiveSteps(config.steps_dir, config.host, lambda: self.state.pid_global_rank)
        self.ingest = Ingest(
            config.shms_dir,
            config.logs_dir,
            config.state_dir,
            self.state,
            config.batch_records,
            proc_root,
            on_batch=self.steps.feed if config.steps_enabled else None,
        )
        self.samplers = Samplers(config.sample_interval, config.sysfs_root)
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
            metadata_dir=config.home / "metadata",
        )
        self.reporter = LiveReporter(config)
        self.cluster = ClusterView()
        self._names_key: tuple = ((), -1, -1)
        self._tables: list[dict[str, Any]] = []
        self.naming: dict[str, Any] = {}
        self.server: AgentServer | None = None
        self.last_loop = time.monotonic()
        self.last_checkpoint_ns = 0
        self.checkpoint_error = ""
        self.hang_history: list[dict[str, Any]] = []
        self._dropped_seen: dict[str, int] = {}
        self.diagnosis: dict[str, Any] | None = None
        self._diagnosed_at = 0.0
        self._seal_wait: tuple[float, dict[str, int]] | None = None  # (deadline, ring -> seal request)
        self._rate_mark = (time.monotonic(), time.process_time(), 0)
        self.agent_rates = {"records_per_s": None, "cpu_pct": None}

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self.archiver.recover()
        self.steps.restore()
        self.ingest.restore()
        self.samplers.start()
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
                    self.request_seals()
                    next_seal = now + cfg.archive_interval
                if self._seal_wait is not None and self._seals_acknowledged(now):
                    self._seal_wait = None
                    self.seal()
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
        self.refresh_group_names()
        self._ask_for_inflight()
        current, new = self.state.detect_hangs()
        if new:
            self.on_hang(new)
        self._diagnose(current, bool(new))

    def _ask_for_inflight(self) -> None:
        """Have every writer report ops in flight past a third of the smallest threshold (its own scan, 1/s)."""
        age = self.state.min_threshold_s() / 3.0
        for ring in self.ingest.rings.values():
            ring.reader.set_inflight_report(age)

    def _diagnose(self, suspicions: list[dict[str, Any]], changed: bool) -> None:
        """Name the root cause of a suspected hang with the CLI's chain analysis over the live state."""
        cluster_hang = self.config.mode == "master" and any(r.get("hang") for r in self.cluster.reports.values())
        if not suspicions and not cluster_hang:
            self.diagnosis = None
            return
        now = time.monotonic()
        if not changed and now - self._diagnosed_at < DIAGNOSIS_INTERVAL_S:
            return
        self._diagnosed_at = now
        try:
            result = diagnose(self.evidence())
        except Exception:
            log.exception("live root-cause analysis failed; suspicions stand without it")
            return
        if result and (not self.diagnosis or result["root_cause_ranks"] != self.diagnosis["root_cause_ranks"]):
            result["diagnosed_ns"] = time.time_ns()
            log.error("hang root cause: %s", result["summary"])
            self.diagnosis = result
            self.hang_history = [*self.hang_history, {"kind": "comminsight.hang.root_cause", **result}][-50:]
            self.report_live()
        elif result:
            self.diagnosis = {**result, "diagnosed_ns": self.diagnosis["diagnosed_ns"] if self.diagnosis else 0}

    def evidence(self) -> list[NodeEvidence]:
        """This node's diagnosis evidence, plus (on a master) each slave's latest."""
        items = [NodeEvidence(self.config.node, self.state.evidence_records(), dict(self.state.pid_global_rank))]
        if self.config.mode == "master":
            for node, report in list(self.cluster.reports.items()):
                if node == self.config.node or "evidence" not in report:
                    continue
                try:
                    items.append(NodeEvidence.from_json(node, report["evidence"]))
                except (ValueError, TypeError) as exc:
                    log.warning("evidence from node %s unusable: %s", node, exc)
        return items

    def heartbeat_evidence(self) -> list[dict[str, Any]]:
        """This master's nodes' evidence for the site, capped to ``HEARTBEAT_EVIDENCE_RECORDS`` in all."""
        items = [e for e in self.evidence() if len(e.records)]
        if not items:
            return []
        share = min(SENT_EVIDENCE_RECORDS, max(64, HEARTBEAT_EVIDENCE_RECORDS // len(items)))
        return [{"node": e.node, **e.capped(share).to_json()} for e in items]

    def refresh_group_names(self) -> None:
        """Join the hook's process-group tables (<home>/metadata) to the live communicators.

        Tables are re-read only when the folder changed; the join itself is redone when the set of
        communicators grew (a handful per job, so this costs nothing per poll).
        """
        metadata = self.config.home / "metadata"
        try:
            signature = tuple(
                sorted(
                    (p.name, p.stat().st_mtime_ns, p.stat().st_size)
                    for p in metadata.iterdir()
                    if TABLE_NAME.match(p.name)
                )
            )
        except OSError:
            signature = ()
        key = (signature, len(self.state.comms), sum(len(c.ranks) for c in list(self.state.comms.values())))
        if key == self._names_key:
            return
        if signature != self._names_key[0]:
            self._tables = load_tables(metadata) if signature else []
        self._names_key = key
        observations = self.state.observations()
        names = name_communicators(observations, self._tables)
        self.state.set_group_names(names)
        self.naming = naming_summary(observations, names, self._tables)

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
            # Steps first: a crash between the two leaves the step engine ahead, and it skips the records
            # it already fed when the ring replays them (LiveSteps.fed_seq).
            self.steps.checkpoint()
            self.ingest.checkpoint()
            self.last_checkpoint_ns = time.time_ns()
            self.checkpoint_error = ""
        except OSError as exc:
            self.checkpoint_error = str(exc)
            log.error("checkpoint failed: %s (ring tails not published, nothing lost)", exc)

    def request_seals(self) -> None:
        """Ask every live writer to seal its open segment, so the archive about to be made is current."""
        requests = {}
        for name, ring in self.ingest.rings.items():
            if not ring.reader.counters()["writer_closed"] and lifeline.pid_alive(
                ring.reader.info.writer_pid, self.ingest.proc_root
            ):
                requests[name] = ring.reader.request_seal()
        self._seal_wait = (time.monotonic() + SEAL_ACK_WAIT_S, requests)

    def _seals_acknowledged(self, now: float) -> bool:
        assert self._seal_wait is not None
        deadline, requests = self._seal_wait
        if now >= deadline:
            return True  # a writer that does not answer (old profiler, stuck process) does not hold the seal
        for name, request in requests.items():
            ring = self.ingest.rings.get(name)
            if ring is not None and ring.reader.seal_done < request:
                return False
        return True

    def seal(self, final: bool = False) -> None:
        self.ingest.tail_segments()  # live state sees a segment's records before the seal removes it
        if final and self.config.steps_enabled and not self._writers_alive():
            # The job is over on this node: its open steps are final. (An agent restarted under a running
            # job keeps them open in its checkpoint instead, so the series continues without a seam.)
            try:
                self.steps.flush()
            except Exception:
                log.exception("final step flush failed")
        extra, steps_upto, metrics = self._extra_members()
        try:
            entry = self.archiver.seal(final=final, extra=extra)
        except OSError as exc:
            log.error("seal failed: %s (inputs kept for the next seal)", exc)
            entry = None
        if entry is not None:
            self.steps.mark_archived(steps_upto)
        elif metrics is not None:
            self.samplers.restore_table(metrics)
        for base in list(self.ingest.segment_offsets):
            if not (self.config.logs_dir / base).exists() and not (self.config.logs_dir / f"{base}.sealed").exists():
                self.ingest.forget_segment(base)

    def _extra_members(self) -> tuple[list[ArchiveMember], dict[str, int], bytes | None]:
        """Step summaries and counter samples not archived yet, as archive members."""
        extra = []
        stamp = time.time_ns()
        lines, upto = self.steps.unarchived()
        if lines:
            extra.append(ArchiveMember(f"steps/steps-{stamp}.jsonl", data=lines, records=lines.count(b"\n")))
        metrics = self.samplers.take_table()
        if metrics is not None:
            extra.append(ArchiveMember(f"metrics/samples-{stamp}.parquet", data=metrics))
        return extra, upto, metrics

    def shutdown(self) -> None:
        log.info("shutting down: final consume, checkpoint and seal")
        self.samplers.stop()
        try:
            self.ingest.discover_rings()
            self.step()
            self.checkpoint()
            self.seal(final=True)
            self.checkpoint()
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
        view: dict[str, Any] = {"hang": bool(current), "suspicions": current, "history": self.hang_history[-10:]}
        if current and self.diagnosis:
            view.update(
                root_cause_ranks=self.diagnosis["root_cause_ranks"],
                first_stuck=self.diagnosis["first_stuck"],
                summary=self.diagnosis["summary"],
                diagnosed_ns=self.diagnosis["diagnosed_ns"],
            )
        return view

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
        hang: dict[str, Any] | None = None
        if hangs:
            hang = {"suspicions": hangs, "root_cause_ranks": None, "first_stuck": None}
            if self.diagnosis:
                hang.update(
                    root_cause_ranks=self.diagnosis["root_cause_ranks"],
                    first_stuck=self.diagnosis["first_stuck"],
                    summary=self.diagnosis["summary"],
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
            "hang": hang,
            "steps": self._merged_steps(),
            "devices": self.samplers.devices,
            "nics": self.samplers.nics,
            "agent": self.agent_view(),
        }

    def _merged_steps(self) -> list[dict[str, Any]]:
        """Latest step per rank: this node's, plus (on a master) its slaves' (ranks are global)."""
        steps = {s["rank"]: s for s in self.steps.latest_steps()}
        if self.config.mode == "master":
            for node, report in list(self.cluster.reports.items()):
                if node == self.config.node or not isinstance(report.get("steps"), list):
                    continue
                for s in report["steps"]:
                    if isinstance(s, dict) and isinstance(s.get("rank"), int) and s["rank"] not in steps:
                        steps[s["rank"]] = s
        return [steps[r] for r in sorted(steps)]

    def agent_view(self) -> dict[str, Any]:
        """The agent's own health for the heartbeat: rate, drops, in-flight ops, CPU share of one core."""
        now, cpu = time.monotonic(), time.process_time()
        then, cpu_then, records_then = self._rate_mark
        if now - then >= 1.0:
            self.agent_rates = {
                "records_per_s": round((self.state.records_applied - records_then) / (now - then), 3),
                "cpu_pct": round(100.0 * (cpu - cpu_then) / (now - then), 3),
            }
            self._rate_mark = (now, cpu, self.state.records_applied)
        dropped = sum(self.ingest.counters.ring_dropped.values()) + sum(self.ingest.counters.ring_lost.values())
        return {
            "records_per_s": self.agent_rates["records_per_s"],
            "dropped_records": dropped,
            "inflight_ops": len(self.state.inflight),
            "cpu_pct": self.agent_rates["cpu_pct"],
        }

    def report_live(self, final: bool = False) -> None:
        if self.reporter.target:
            self.reporter.post(self.report_payload(final))

    def report_payload(self, final: bool = False) -> dict[str, Any]:
        """The live report: to the master (slave mode) or the site, with diagnosis evidence when it helps."""
        payload = self.live_payload()
        if self.config.mode == "slave":
            # To the master: the suspicions as a list (ClusterView merges them) and the evidence
            # its live chain analysis needs from this node.
            payload["hang"] = list(self.state.suspicions.values())
            payload["evidence"] = self.evidence()[0].capped().to_json()
        elif self.state.suspicions or self.diagnosis or self.reporter.site_status == "hung":
            # To the site: every node's evidence while a hang is suspected here or anywhere in the job,
            # so the site can run the chain analysis across masters that report separately.
            payload["evidence"] = self.heartbeat_evidence()
        payload["finished"] = final and not self._writers_alive()
        return payload

    def _writers_alive(self) -> bool:
        """Whether any writer process of a ring on this node still runs (the job is not finished)."""
        for ring in self.ingest.rings.values():
            if not ring.reader.counters()["writer_closed"] and lifeline.pid_alive(
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
    # Started by a training process (the profiler's autostart) or a tool (the site's demo): when that
    # process ends, however it ends, stop as on SIGTERM: final seal, last report, delivery.
    lifeline.watch_parent(signal.SIGTERM)
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
