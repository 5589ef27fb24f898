"""Device and NIC counters: sysfs port counters from a fixture tree, NVML through its seam."""

from __future__ import annotations

import io
import logging
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest

from comminsight.agent.samplers import GpuSampler, NicSampler, Samplers


def write_port(root: Path, device: str, port: int, counters: dict[str, int], hw: dict[str, int] | None = None) -> None:
    base = root / "class" / "infiniband" / device / "ports" / str(port)
    (base / "counters").mkdir(parents=True, exist_ok=True)
    for name, value in counters.items():
        (base / "counters" / name).write_text(f"{value}\n")
    if hw:
        (base / "hw_counters").mkdir(exist_ok=True)
        for name, value in hw.items():
            (base / "hw_counters" / name).write_text(f"{value}\n")


def port_counters(words: int, packets: int, errors: int = 0, discards: int = 0) -> dict[str, int]:
    return {
        "port_rcv_data": words,
        "port_xmit_data": 2 * words,
        "port_rcv_packets": packets,
        "port_xmit_packets": packets,
        "port_rcv_errors": errors,
        "symbol_error": 0,
        "port_xmit_discards": discards,
    }


def test_port_counters_become_rates_in_bytes_per_second(tmp_path: Path) -> None:
    write_port(tmp_path, "mlx5_0", 1, port_counters(1000, 10), {"out_of_buffer": 0})
    nic = NicSampler(tmp_path)
    first = nic.sample(now=100.0)
    assert first[0]["rx_bytes_per_s"] is None  # one sample is no rate yet
    write_port(tmp_path, "mlx5_0", 1, port_counters(3500, 60, errors=4, discards=1), {"out_of_buffer": 2})
    (port,) = nic.sample(now=105.0)
    assert port["device"] == "mlx5_0"
    assert port["port"] == 1
    assert port["rx_bytes_per_s"] == pytest.approx(2500 * 4 / 5)  # data counters count 4-byte words
    assert port["tx_bytes_per_s"] == pytest.approx(5000 * 4 / 5)
    assert port["rx_packets_per_s"] == pytest.approx(10.0)
    assert port["errors_per_s"] == pytest.approx(4 / 5)
    assert port["discards_per_s"] == pytest.approx(3 / 5)


def test_a_counter_that_went_backwards_gives_no_rate_that_interval(tmp_path: Path) -> None:
    write_port(tmp_path, "mlx5_1", 1, port_counters(9000, 100))
    nic = NicSampler(tmp_path)
    nic.sample(now=0.0)
    write_port(tmp_path, "mlx5_1", 1, port_counters(10, 1))  # counters reset
    (port,) = nic.sample(now=5.0)
    assert port["rx_bytes_per_s"] is None
    assert port["rx_packets_per_s"] is None
    write_port(tmp_path, "mlx5_1", 1, port_counters(510, 11))
    (port,) = nic.sample(now=10.0)
    assert port["rx_bytes_per_s"] == pytest.approx(500 * 4 / 5)


def test_missing_and_garbled_counter_files_are_skipped_with_one_log_line(tmp_path: Path, caplog) -> None:
    write_port(tmp_path, "mlx5_0", 1, port_counters(1, 1))
    (tmp_path / "class/infiniband/mlx5_0/ports/1/counters/port_rcv_errors").write_text("garbage\n")
    (tmp_path / "class/infiniband/mlx5_2/ports/1").mkdir(parents=True)  # no counters/ at all
    nic = NicSampler(tmp_path)
    with caplog.at_level(logging.WARNING, logger="comminsight.agent.samplers"):
        nic.sample(now=0.0)
        ports = nic.sample(now=1.0)
    assert [p["device"] for p in ports] == ["mlx5_0"]
    garbled = [r for r in caplog.records if "port_rcv_errors" in r.getMessage()]
    assert len(garbled) == 1


def test_no_infiniband_directory_means_the_nic_sampler_is_off(tmp_path: Path) -> None:
    samplers = Samplers(5.0, tmp_path, nvml=FakeNvml(0))
    samplers.start()
    assert not samplers.nic_on
    assert samplers.thread is None
    samplers.stop()


class FakeNvml:
    """The pynvml names the sampler uses, for ``count`` GPUs (a stand-in, shaped like the real module)."""

    NVML_CLOCK_SM = 1
    NVML_PCIE_UTIL_TX_BYTES = 0
    NVML_PCIE_UTIL_RX_BYTES = 1
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139

    def __init__(self, count: int, fail_init: Exception | None = None) -> None:
        self.count = count
        self.fail_init = fail_init
        self.nvlink_kib = 0

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise self.fail_init

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-{h:04d}"

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=90 + h, memory=10)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(used=1 << 30, total=80 << 30, free=79 << 30)

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return 612_500  # milliwatts

    def nvmlDeviceGetClockInfo(self, h: int, kind: int) -> int:
        return 1980

    def nvmlDeviceGetPcieThroughput(self, h: int, kind: int) -> int:
        raise RuntimeError("Not Supported")

    def nvmlDeviceGetFieldValues(self, h: int, fields: list[int]) -> list[SimpleNamespace]:
        return [
            SimpleNamespace(nvmlReturn=0, value=SimpleNamespace(ullVal=self.nvlink_kib * (1 + i))) for i in range(2)
        ]


def test_gpu_samples_through_the_nvml_seam_with_rates_and_unsupported_metrics_null() -> None:
    nvml = FakeNvml(2)
    gpu = GpuSampler(nvml)
    assert gpu.start()
    gpu.sample(now=0.0)
    nvml.nvlink_kib = 5 * 1024
    devices = gpu.sample(now=5.0)
    assert [d["uuid"] for d in devices] == ["GPU-0000", "GPU-0001"]
    d = devices[1]
    assert d["util_pct"] == 91.0
    assert d["power_w"] == 612.5
    assert d["sm_clock_mhz"] == 1980
    assert d["mem_total_bytes"] == 80 << 30
    assert d["nvlink_tx_bytes_per_s"] == pytest.approx(1024 * 1024)
    assert d["nvlink_rx_bytes_per_s"] == pytest.approx(2 * 1024 * 1024)
    assert d["pcie_tx_bytes_per_s"] is None  # not supported: null, never a crash


def test_gpu_sampler_is_off_and_says_so_once_without_a_driver(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="comminsight.agent.samplers"):
        gpu = GpuSampler(FakeNvml(0, fail_init=RuntimeError("NVML Shared Library Not Found")))
        assert not gpu.start()
    assert "Library Not Found" in gpu.off_reason
    assert len([r for r in caplog.records if "GPU sampler off" in r.getMessage()]) == 1
    assert gpu.sample() == []


def test_samples_go_into_an_archive_table_once(tmp_path: Path) -> None:
    write_port(tmp_path, "mlx5_0", 1, port_counters(1000, 10))
    samplers = Samplers(5.0, tmp_path, nvml=FakeNvml(1))
    samplers.gpu_on = samplers.gpu.start()
    samplers.nic_on = True
    samplers.sample_once()
    write_port(tmp_path, "mlx5_0", 1, port_counters(2000, 20))
    samplers.sample_once()
    data = samplers.take_table()
    assert data is not None
    table = pq.read_table(io.BytesIO(data)).to_pylist()
    kinds = {(r["kind"], r["metric"]) for r in table}
    assert ("gpu", "util_pct") in kinds
    assert ("nic", "rx_bytes_per_s") in kinds
    assert samplers.take_table() is None
