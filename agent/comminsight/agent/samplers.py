"""Device and network counters of the node, sampled by the agent off the training hot path.

- **GPUs** through NVML (``nvidia-ml-py``, module ``pynvml``): utilisation, memory, power, SM clock,
  NVLink data throughput (cumulative KiB counters turned into rates) and PCIe throughput (NVML's
  own rate). The library is a seam: ``GpuSampler(nvml)`` takes any object with pynvml's function
  names; the real module satisfies it, tests pass a stand-in. No library, no driver or no GPU:
  the sampler is off and says so once.
- **InfiniBand / RoCE ports** from ``<root>/class/infiniband/<dev>/ports/<port>/counters`` and
  ``hw_counters`` (``root`` is injectable; tests point it at a fixture tree shaped like sysfs):
  byte, packet, error and discard counters turned into rates. A counter that went backwards (a
  reset, a wrap) gives no rate for that interval (null, never negative) and one log line; a
  missing or unreadable file is skipped with one log line.

Samples run in their own thread every ``interval`` seconds; the latest values feed Prometheus,
the live heartbeat (``devices``, ``nics``) and, as a long table (time, kind, device, port,
metric, value), the next archive (``metrics/samples-*.parquet``).
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

log = logging.getLogger("comminsight.agent.samplers")
MAX_TABLE_ROWS = 200_000  # samples kept for the next archive; the oldest go first beyond this

# port_*_data counts 4-byte words (InfiniBand spec); everything else counts units.
_IB_BYTES = {"rx": "port_rcv_data", "tx": "port_xmit_data"}
_IB_PACKETS = {"rx": "port_rcv_packets", "tx": "port_xmit_packets"}
_IB_ERRORS = (
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors",
    "port_xmit_constraint_errors",
    "port_rcv_constraint_errors",
    "symbol_error",
    "link_error_recovery",
    "link_downed",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
)
_IB_DISCARDS = ("port_xmit_discards", "out_of_buffer", "rx_discards_phy")


def _rate(prev: float | None, cur: float | None, dt: float) -> float | None:
    """Per-second rate of a cumulative counter; None when unknown or when it went backwards."""
    if prev is None or cur is None or dt <= 0 or cur < prev:
        return None
    return (cur - prev) / dt


class _Once:
    """Log a message once per key (a missing file, a reset counter) so a bad node does not flood the log."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def warn(self, key: str, message: str, *args: Any) -> None:
        if key not in self.seen:
            self.seen.add(key)
            log.warning(message, *args)


class _PortRates:
    """Rates of one port between two samples."""

    def __init__(self, key: tuple[str, int], prev: dict[str, int], values: dict[str, int], dt: float) -> None:
        self.key, self.prev, self.values, self.dt = key, prev, values, dt

    def rate(self, name: str, scale: float = 1.0) -> float | None:
        r = _rate(self.prev.get(name), self.values.get(name), self.dt)
        if r is None and name in self.prev and name in self.values and self.values[name] < self.prev[name]:
            log.info("NIC counter %s/%d %s went backwards (reset): no rate this interval", *self.key, name)
        return None if r is None else r * scale

    def summed(self, names: tuple[str, ...]) -> float | None:
        """Sum of the rates of those counters the port has; None when any of them has no rate."""
        present = [n for n in names if n in self.values and n in self.prev]
        if not present:
            return None
        rates = [self.rate(n) for n in present]
        return None if any(r is None for r in rates) else float(sum(r for r in rates if r is not None))


# ---- InfiniBand / RoCE ----------------------------------------------------------------------------
class NicSampler:
    def __init__(self, sysfs_root: Path) -> None:
        self.base = Path(sysfs_root) / "class" / "infiniband"
        self.prev: dict[tuple[str, int], tuple[float, dict[str, int]]] = {}
        self.once = _Once()
        self.latest: list[dict[str, Any]] = []
        self.totals: dict[tuple[str, int, str], int] = {}

    @property
    def available(self) -> bool:
        return self.base.is_dir()

    def _read_port(self, port_dir: Path) -> dict[str, int]:
        values: dict[str, int] = {}
        for sub in ("counters", "hw_counters"):
            directory = port_dir / sub
            try:
                entries = sorted(directory.iterdir())
            except OSError:
                if sub == "counters":
                    self.once.warn(f"dir:{directory}", "NIC counters: cannot list %s; port skipped", directory)
                continue
            for entry in entries:
                try:
                    values[entry.name] = int(entry.read_text().split()[0])
                except (OSError, ValueError, IndexError) as exc:
                    self.once.warn(f"file:{entry}", "NIC counters: cannot read %s (%s); counter skipped", entry, exc)
        return values

    def sample(self, now: float | None = None) -> list[dict[str, Any]]:
        now = time.monotonic() if now is None else now
        out = []
        try:
            devices = sorted(p for p in self.base.iterdir() if p.is_dir())
        except OSError:
            return []
        for dev in devices:
            try:
                ports = sorted((p for p in (dev / "ports").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
            except OSError:
                self.once.warn(f"ports:{dev}", "NIC counters: %s has no readable ports/ directory", dev)
                continue
            for port_dir in ports:
                key = (dev.name, int(port_dir.name))
                values = self._read_port(port_dir)
                if not values:
                    continue
                prev_t, prev = self.prev.get(key, (None, {}))
                dt = now - prev_t if prev_t is not None else 0.0
                port = _PortRates(key, prev, values, dt)
                out.append(
                    {
                        "device": dev.name,
                        "port": key[1],
                        "rx_bytes_per_s": port.rate(_IB_BYTES["rx"], 4.0),
                        "tx_bytes_per_s": port.rate(_IB_BYTES["tx"], 4.0),
                        "rx_packets_per_s": port.rate(_IB_PACKETS["rx"]),
                        "tx_packets_per_s": port.rate(_IB_PACKETS["tx"]),
                        "errors_per_s": port.summed(_IB_ERRORS),
                        "discards_per_s": port.summed(_IB_DISCARDS),
                    }
                )
                for name in (*_IB_BYTES.values(), *_IB_PACKETS.values(), *_IB_ERRORS, *_IB_DISCARDS):
                    if name in values:
                        self.totals[(dev.name, key[1], name)] = values[name] * (4 if name in _IB_BYTES.values() else 1)
                self.prev[key] = (now, values)
        self.latest = out
        return out


# ---- GPUs through NVML ----------------------------------------------------------------------------
class GpuSampler:
    """NVML through any object with pynvml's names (the real ``pynvml`` module satisfies it)."""

    def __init__(self, nvml: Any | None = None) -> None:
        self.nvml = nvml
        self.handles: list[Any] = []
        self.uuids: list[str] = []
        self.prev: dict[int, tuple[float, int | None, int | None]] = {}
        self.latest: list[dict[str, Any]] = []
        self.off_reason = ""
        self.once = _Once()

    def start(self) -> bool:
        """Initialise NVML; False (and one log line) when there is no library, driver or GPU."""
        nvml = self.nvml
        if nvml is None:
            try:
                import pynvml as nvml  # nvidia-ml-py
            except ImportError:
                self.off_reason = "nvidia-ml-py is not installed"
                log.info("GPU sampler off: %s", self.off_reason)
                return False
            self.nvml = nvml
        try:
            nvml.nvmlInit()
            count = nvml.nvmlDeviceGetCount()
            self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self.uuids = [_str(nvml.nvmlDeviceGetUUID(h)) for h in self.handles]
        except Exception as exc:  # NVMLError and its many subclasses; a broken driver must not stop the agent
            self.off_reason = f"NVML unavailable: {exc}"
            log.info("GPU sampler off: %s", self.off_reason)
            return False
        if not self.handles:
            self.off_reason = "no GPU visible to NVML"
            log.info("GPU sampler off: %s", self.off_reason)
            return False
        log.info("GPU sampler on: %d GPU(s)", len(self.handles))
        return True

    def _call(self, index: int, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:  # a metric a GPU does not support (NOT_SUPPORTED) is null, said once
            self.once.warn(f"{index}:{what}", "GPU %d: %s not available (%s)", index, what, exc)
            return None

    def _nvlink_kib(self, index: int, handle: Any) -> tuple[int | None, int | None]:
        nvml = self.nvml
        fields = [nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX]
        values = self._call(index, "NVLink throughput", nvml.nvmlDeviceGetFieldValues, handle, fields)
        if not values:
            return None, None
        out: list[int | None] = []
        for fv in values:
            ok = getattr(fv, "nvmlReturn", 0) == 0
            out.append(int(fv.value.ullVal) if ok else None)
        return out[0], out[1]

    def sample(self, now: float | None = None) -> list[dict[str, Any]]:
        now = time.monotonic() if now is None else now
        nvml = self.nvml
        out = []
        for i, handle in enumerate(self.handles):
            util = self._call(i, "utilisation", nvml.nvmlDeviceGetUtilizationRates, handle)
            mem = self._call(i, "memory", nvml.nvmlDeviceGetMemoryInfo, handle)
            power = self._call(i, "power", nvml.nvmlDeviceGetPowerUsage, handle)
            clock = self._call(i, "SM clock", nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM)
            pcie_tx = self._call(i, "PCIe TX", nvml.nvmlDeviceGetPcieThroughput, handle, nvml.NVML_PCIE_UTIL_TX_BYTES)
            pcie_rx = self._call(i, "PCIe RX", nvml.nvmlDeviceGetPcieThroughput, handle, nvml.NVML_PCIE_UTIL_RX_BYTES)
            tx_kib, rx_kib = self._nvlink_kib(i, handle)
            prev_t, prev_tx, prev_rx = self.prev.get(i, (None, None, None))
            dt = now - prev_t if prev_t is not None else 0.0
            tx_rate, rx_rate = _rate(prev_tx, tx_kib, dt), _rate(prev_rx, rx_kib, dt)
            self.prev[i] = (now, tx_kib, rx_kib)
            out.append(
                {
                    "gpu": i,
                    "uuid": self.uuids[i],
                    "util_pct": float(util.gpu) if util is not None else None,
                    "mem_used_bytes": int(mem.used) if mem is not None else None,
                    "mem_total_bytes": int(mem.total) if mem is not None else None,
                    "power_w": power / 1000.0 if power is not None else None,
                    "sm_clock_mhz": int(clock) if clock is not None else None,
                    "nvlink_tx_bytes_per_s": tx_rate * 1024.0 if tx_rate is not None else None,
                    "nvlink_rx_bytes_per_s": rx_rate * 1024.0 if rx_rate is not None else None,
                    # NVML's PCIe throughput is already a rate, in KB/s over a 20 ms window.
                    "pcie_tx_bytes_per_s": pcie_tx * 1024.0 if pcie_tx is not None else None,
                    "pcie_rx_bytes_per_s": pcie_rx * 1024.0 if pcie_rx is not None else None,
                }
            )
        self.latest = out
        return out

    def stop(self) -> None:
        if self.handles and self.nvml is not None:
            try:
                self.nvml.nvmlShutdown()
            except Exception as exc:  # shutting down a broken driver: nothing left to do
                log.debug("nvmlShutdown: %s", exc)


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# ---- the sampling thread --------------------------------------------------------------------------
class Samplers:
    """Both samplers on one background thread; ``devices``/``nics`` are the latest values."""

    def __init__(self, interval: float, sysfs_root: Path, nvml: Any | None = None) -> None:
        self.interval = interval
        self.gpu = GpuSampler(nvml)
        self.nic = NicSampler(sysfs_root)
        self.gpu_on = False
        self.nic_on = False
        self.table: deque[tuple[int, str, str, int, str, float]] = deque(maxlen=MAX_TABLE_ROWS)
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None
        self.samples = 0
        self.cpu_s = 0.0

    def start(self) -> None:
        if self.interval <= 0:
            log.info("device and NIC samplers off (COMMINSIGHT_AGENT_SAMPLE_INTERVAL=0)")
            return
        self.gpu_on = self.gpu.start()
        self.nic_on = self.nic.available
        if not self.nic_on:
            log.info("NIC sampler off: no %s", self.nic.base)
        if self.gpu_on or self.nic_on:
            self.thread = threading.Thread(target=self._run, name="comminsight-samplers", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        while not self.stop_event.is_set():
            try:
                self.sample_once()
            except Exception:
                log.exception("sampling failed; trying again next interval")
            self.stop_event.wait(self.interval)

    def sample_once(self) -> None:
        t0 = time.thread_time()
        now, wall = time.monotonic(), time.time_ns()
        devices = self.gpu.sample(now) if self.gpu_on else []
        nics = self.nic.sample(now) if self.nic_on else []
        rows = []
        for d in devices:
            rows.extend(
                (wall, "gpu", d["uuid"] or str(d["gpu"]), d["gpu"], k, float(v))
                for k, v in d.items()
                if k not in ("gpu", "uuid") and v is not None
            )
        for n in nics:
            rows.extend(
                (wall, "nic", n["device"], n["port"], k, float(v))
                for k, v in n.items()
                if k not in ("device", "port") and v is not None
            )
        with self.lock:
            self.table.extend(rows)
            self.samples += 1
            self.cpu_s += time.thread_time() - t0

    def stop(self) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout=5.0)
        self.gpu.stop()

    @property
    def devices(self) -> list[dict[str, Any]]:
        return list(self.gpu.latest)

    @property
    def nics(self) -> list[dict[str, Any]]:
        return list(self.nic.latest)

    def take_table(self) -> bytes | None:
        """The samples since the last call as a Parquet table (None when there are none); the rows leave."""
        with self.lock:
            rows = list(self.table)
            self.table.clear()
        if not rows:
            return None
        from comminsight.formats.samples import samples_parquet  # pyarrow: only when a seal needs it

        return samples_parquet(rows)

    def restore_table(self, data: bytes) -> None:
        """Put rows back (a seal that failed) so the next archive still has them."""
        import pyarrow.parquet as pq

        table = pq.read_table(io.BytesIO(data))
        rows = zip(*(table.column(c).to_pylist() for c in table.column_names), strict=True)
        with self.lock:
            self.table.extendleft(reversed(list(rows)))
