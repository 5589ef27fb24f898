"""The metrics the site keeps as time series, and how each is charted.

``per`` says what one series of the metric is (its ``Series.key``): a rank, a communicator, a node, a GPU
(``<node>/gpu<i>``), a NIC port (``<node>/<device>:<port>``) or the whole workload (``all``).
``source`` says who feeds it: live heartbeats (docs/formats/upload.md, "Live heartbeat") or the archive
summaries computed after ingest (``services.archive_summaries_record``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    name: str
    title: str
    unit: str
    per: str  # rank | communicator | node | gpu | nic | workload
    source: str  # heartbeat | archive | both


METRICS: dict[str, Metric] = {
    m.name: m
    for m in (
        Metric("step_duration_s", "Step time per rank", "s", "rank", "both"),
        Metric("coll_algbw_gbs", "Collective throughput per communicator (algbw)", "GB/s", "communicator", "archive"),
        Metric("coll_busbw_gbs", "Bus bandwidth per communicator", "GB/s", "communicator", "archive"),
        Metric("inflight_ops", "Operations in flight per node", "ops", "node", "heartbeat"),
        Metric("lagging_ranks", "Lagging ranks", "ranks", "workload", "heartbeat"),
        Metric("dropped_records", "Dropped records per node (total)", "records", "node", "heartbeat"),
        Metric("agent_records_per_s", "Agent: records consumed per second", "records/s", "node", "heartbeat"),
        Metric("agent_cpu_pct", "Agent: CPU", "%", "node", "heartbeat"),
        Metric("gpu_util_pct", "GPU utilisation", "%", "gpu", "heartbeat"),
        Metric("gpu_mem_used_bytes", "GPU memory used", "bytes", "gpu", "heartbeat"),
        Metric("gpu_power_w", "GPU power", "W", "gpu", "heartbeat"),
        Metric("nic_rx_bytes_per_s", "NIC receive throughput", "bytes/s", "nic", "heartbeat"),
        Metric("nic_tx_bytes_per_s", "NIC transmit throughput", "bytes/s", "nic", "heartbeat"),
        Metric("nic_errors_per_s", "NIC errors", "errors/s", "nic", "heartbeat"),
        Metric("nic_discards_per_s", "NIC discards", "discards/s", "nic", "heartbeat"),
    )
}

# What the dashboards draw, in order (the all-workloads overview draws the first few per workload).
DASHBOARD = list(METRICS)
OVERVIEW = ["step_duration_s", "coll_busbw_gbs", "lagging_ranks", "gpu_util_pct", "nic_errors_per_s"]
NIC_METRICS = ("nic_rx_bytes_per_s", "nic_tx_bytes_per_s", "nic_errors_per_s", "nic_discards_per_s")
