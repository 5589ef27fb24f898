"""The agent's HTTP endpoint: /healthz, /metrics (Prometheus), the JSON runtime API, and the master's
cluster report endpoint. Spec: docs/agent.md.

Metrics are produced at scrape time by a custom collector reading the live state's aggregates, so the
ingest path never touches a metric object per event. The server is the stdlib threading server:
requests are few (scrapes, an engineer's ``agent status``, slave reports) and each is a snapshot.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from comminsight.agent.cluster import ReportError
from comminsight.formats.boundedjson import loads_bounded

if TYPE_CHECKING:
    from comminsight.agent.daemon import Agent

log = logging.getLogger("comminsight.agent.server")
MAX_BODY_BYTES = 8 << 20


class AgentCollector:
    """Prometheus collector over the agent's state (called per scrape)."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def collect(self) -> Iterator[Metric]:
        agent = self.agent
        ops = CounterMetricFamily(
            "comminsight_operations",
            "Completed operations seen, by communicator and op",
            labels=["comm", "comm_name", "op"],
        )
        nbytes = CounterMetricFamily(
            "comminsight_bytes", "Payload bytes of completed operations", labels=["comm", "comm_name", "op"]
        )
        busbw = GaugeMetricFamily(
            "comminsight_bus_bandwidth_bytes_per_second",
            "Bus bandwidth of the latest batch (bytes x bus factor / duration)",
            labels=["comm", "comm_name", "op"],
        )
        lagging = GaugeMetricFamily(
            "comminsight_lagging_ranks", "Ranks behind the most advanced rank", labels=["comm", "comm_name"]
        )
        with agent.state.lock:
            for c in agent.state.comms.values():
                cid = f"0x{c.comm_hash:016x}"
                for func, s in c.ops.items():
                    ops.add_metric([cid, c.name, func], s.count)
                    nbytes.add_metric([cid, c.name, func], s.bytes)
                    busbw.add_metric([cid, c.name, func], s.busbw)
                lagging.add_metric([cid, c.name], len(agent.state.lagging_ranks(c)))
            inflight_n = len(agent.state.inflight)
            hangs = len(agent.state.suspicions)
        yield from (ops, nbytes, busbw, lagging)
        yield GaugeMetricFamily("comminsight_inflight_operations", "Operations known to be in flight", value=inflight_n)
        yield GaugeMetricFamily(
            "comminsight_inflight_oldest_age_seconds",
            "Age of the oldest in-flight operation",
            value=agent.state.oldest_inflight_age_s(),
        )
        yield GaugeMetricFamily("comminsight_hang_suspected", "Hang suspicions currently raised", value=hangs)
        counters = agent.ingest.counters
        dropped = CounterMetricFamily(
            "comminsight_ring_dropped_records", "Records the writer dropped: ring full", labels=["ring"]
        )
        lost = CounterMetricFamily(
            "comminsight_ring_lost_records", "Records the plugin lost before the ring", labels=["ring"]
        )
        for ring, n in sorted(counters.ring_dropped.items()):
            dropped.add_metric([ring], n)
        for ring, n in sorted(counters.ring_lost.items()):
            lost.add_metric([ring], n)
        yield dropped
        yield lost
        yield CounterMetricFamily(
            "comminsight_records_ingested", "Records applied to the live state", value=agent.state.records_applied
        )
        yield CounterMetricFamily(
            "comminsight_corrupt_records", "Records skipped: bad magic or checksum", value=counters.corrupt_records
        )
        malformed = CounterMetricFamily(
            "comminsight_malformed_inputs", "Malformed rings or segments skipped", labels=["kind"]
        )
        malformed.add_metric(["ring"], counters.malformed_rings)
        malformed.add_metric(["segment"], counters.malformed_segments + agent.archiver.stats.quarantined)
        yield malformed
        yield GaugeMetricFamily("comminsight_rings", "Rings being consumed", value=len(agent.ingest.rings))
        yield GaugeMetricFamily(
            "comminsight_agent_lag_records", "Committed ring records not yet consumed", value=counters.lag_records
        )
        yield GaugeMetricFamily(
            "comminsight_agent_lag_seconds", "Now minus the newest record's completion time", value=agent.lag_seconds()
        )
        n_archives, spool_bytes, spool_age = agent.spool.usage()
        yield GaugeMetricFamily("comminsight_spool_archives", "Archives waiting in the spool", value=n_archives)
        yield GaugeMetricFamily("comminsight_spool_bytes", "Bytes waiting in the spool", value=spool_bytes)
        yield GaugeMetricFamily(
            "comminsight_spool_oldest_age_seconds", "Age of the oldest spooled archive", value=spool_age
        )
        stats = agent.spool.stats
        yield CounterMetricFamily(
            "comminsight_spool_dropped_archives", "Archives dropped by the spool caps", value=stats.dropped_archives
        )
        yield CounterMetricFamily(
            "comminsight_spool_dropped_records", "Records in archives dropped by the caps", value=stats.dropped_records
        )
        failures = CounterMetricFamily(
            "comminsight_upload_failures", "Failed delivery attempts by provider", labels=["provider"]
        )
        delivered = CounterMetricFamily(
            "comminsight_archives_delivered", "Archives delivered by provider", labels=["provider"]
        )
        for name in agent.spool.providers:
            failures.add_metric([name], stats.failures.get(name, 0))
            delivered.add_metric([name], stats.delivered.get(name, 0))
        yield failures
        yield delivered
        yield CounterMetricFamily("comminsight_archives_sealed", "Archives sealed", value=agent.archiver.stats.archives)
        yield CounterMetricFamily(
            "comminsight_live_report_failures", "Failed live reports (site or master)", value=agent.reporter.failures
        )
        yield from _step_metrics(agent)
        yield from _sampler_metrics(agent)


def _step_metrics(agent: Agent) -> Iterator[Metric]:
    duration = GaugeMetricFamily(
        "comminsight_step_duration_seconds", "Duration of the latest final step, per rank", labels=["rank"]
    )
    comm = GaugeMetricFamily(
        "comminsight_step_comm_seconds", "Time in communication in the latest final step, per rank", labels=["rank"]
    )
    total = CounterMetricFamily("comminsight_steps", "Final steps recovered live, per rank", labels=["rank"])
    with agent.steps.lock:
        latest = dict(agent.steps.latest)
        totals = dict(agent.steps.steps_total)
    for key, s in sorted(latest.items()):
        label = str(s["rank"]) if s["rank"] >= 0 else f"pid{s['pid']}"
        duration.add_metric([label], s["duration_s"])
        comm.add_metric([label], s["comm_s"])
        total.add_metric([label], totals.get(key, 0))
    yield from (duration, comm, total)
    yield CounterMetricFamily(
        "comminsight_steps_late_records",
        "Records that came after their writer's later-starting ones were fed: fed out of start order",
        value=agent.steps.late_records,
    )


_GPU_METRICS = (
    ("util_pct", "comminsight_gpu_utilization_percent", "GPU utilisation (NVML)"),
    ("mem_used_bytes", "comminsight_gpu_memory_used_bytes", "GPU memory used"),
    ("mem_total_bytes", "comminsight_gpu_memory_total_bytes", "GPU memory total"),
    ("power_w", "comminsight_gpu_power_watts", "GPU power draw"),
    ("sm_clock_mhz", "comminsight_gpu_sm_clock_mhz", "SM clock"),
    ("nvlink_tx_bytes_per_s", "comminsight_gpu_nvlink_tx_bytes_per_second", "NVLink data sent"),
    ("nvlink_rx_bytes_per_s", "comminsight_gpu_nvlink_rx_bytes_per_second", "NVLink data received"),
    ("pcie_tx_bytes_per_s", "comminsight_gpu_pcie_tx_bytes_per_second", "PCIe sent"),
    ("pcie_rx_bytes_per_s", "comminsight_gpu_pcie_rx_bytes_per_second", "PCIe received"),
)
_NIC_METRICS = (
    ("rx_bytes_per_s", "comminsight_nic_rx_bytes_per_second", "Port data received"),
    ("tx_bytes_per_s", "comminsight_nic_tx_bytes_per_second", "Port data sent"),
    ("rx_packets_per_s", "comminsight_nic_rx_packets_per_second", "Port packets received"),
    ("tx_packets_per_s", "comminsight_nic_tx_packets_per_second", "Port packets sent"),
    ("errors_per_s", "comminsight_nic_errors_per_second", "Port errors (sum of the error counters)"),
    ("discards_per_s", "comminsight_nic_discards_per_second", "Port discards"),
)


def _sampler_metrics(agent: Agent) -> Iterator[Metric]:
    devices, nics = agent.samplers.devices, agent.samplers.nics
    for key, name, doc in _GPU_METRICS:
        family = GaugeMetricFamily(name, doc, labels=["gpu", "uuid"])
        for d in devices:
            if d.get(key) is not None:
                family.add_metric([str(d["gpu"]), d["uuid"]], d[key])
        yield family
    for key, name, doc in _NIC_METRICS:
        family = GaugeMetricFamily(name, doc, labels=["device", "port"])
        for n in nics:
            if n.get(key) is not None:
                family.add_metric([n["device"], str(n["port"])], n[key])
        yield family
    totals = CounterMetricFamily(
        "comminsight_nic_counter",
        "Raw port counters as the kernel reports them (bytes for data)",
        labels=["device", "port", "counter"],
    )
    for (device, port, counter), value in sorted(agent.samplers.nic.totals.items()):
        totals.add_metric([device, str(port), counter], value)
    yield totals


def _handler(agent: Agent) -> type[BaseHTTPRequestHandler]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(agent))  # type: ignore[arg-type]

    class Handler(BaseHTTPRequestHandler):
        server_version = "comminsight-agent"
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s %s", self.address_string(), format % args)

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, status: int, payload: Any) -> None:
            self._send(status, json.dumps(payload, indent=1, default=str).encode(), "application/json")

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0].rstrip("/") or "/"
            try:
                if path == "/metrics":
                    self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    health = agent.health()
                    self._json(200 if health["status"] != "stalled" else 503, health)
                elif path == "/api/v1/status":
                    self._json(200, agent.status())
                elif path == "/api/v1/communicators":
                    self._json(200, {"communicators": agent.communicators(), "names": agent.naming})
                elif path == "/api/v1/inflight":
                    self._json(200, {"inflight": agent.state.inflight_view()})
                elif path == "/api/v1/hang":
                    self._json(200, agent.hang_view())
                elif path == "/api/v1/steps":
                    self._json(200, agent.steps.view())
                elif path == "/api/v1/devices":
                    self._json(200, {"devices": agent.samplers.devices, "nics": agent.samplers.nics})
                elif path == "/api/v1/cluster":
                    self._json(200, agent.cluster_view_json())
                else:
                    self._json(404, {"detail": f"no such endpoint {path}"})
            except Exception:
                log.exception("request %s failed", path)
                self._json(500, {"detail": "internal error"})

        do_HEAD = do_GET

        def do_POST(self) -> None:
            path = self.path.split("?", 1)[0].rstrip("/")
            if path != "/api/v1/cluster/report":
                self._json(404, {"detail": f"no such endpoint {path}"})
                return
            if agent.config.mode != "master":
                self._json(409, {"detail": "this agent is not a master"})
                return
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                self._json(411, {"detail": "Content-Length required"})
                return
            if length < 0 or length > MAX_BODY_BYTES:
                self._json(413, {"detail": f"report larger than {MAX_BODY_BYTES} bytes"})
                self.close_connection = True
                return
            raw = self.rfile.read(length)
            try:
                agent.cluster.accept(loads_bounded(raw, what="report", max_bytes=MAX_BODY_BYTES))
            except (ValueError, ReportError) as exc:
                self._json(400, {"detail": f"bad report: {exc}"})
                return
            self._json(202, {"status": "accepted"})

    return Handler


class AgentServer:
    def __init__(self, agent: Agent, host: str, port: int) -> None:
        self.httpd = ThreadingHTTPServer((host, port), _handler(agent))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="comminsight-http", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.httpd.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
