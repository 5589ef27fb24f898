"""Benchmark: JSON readers for the Kineto importer, on recorded trace text.

The Kineto importer needs a few events of a trace (NCCL kernels, ``record_param_comms`` CPU ops,
``ProfilerStep#N`` spans) and a few members of each. This measures, on the same decompressed text,
what each reader costs to get those events out, in CPU seconds and in peak memory above the text:

- ``json``: the standard library parses the whole document, then a filter keeps the events;
- ``orjson``: the same with orjson;
- ``msgspec``: msgspec decodes the whole document into typed structs of the used members only
  (unknown members are skipped without being built);
- ``simdjson``: pysimdjson parses the document on demand; the filter reads name/cat per event;
- ``pyarrow.json``: Arrow's JSON reader (it reads newline-delimited records, so the document is one
  record whose traceEvents column is inferred); reported as refused where it cannot;
- ``scanner``: comminsight's Kineto reader with its bracket scanner only (the reader before msgspec:
  numpy finds the events' bounds, orjson parses those whose text holds a needle);
- ``importer``: comminsight's Kineto reader as shipped (streamed in 8 MiB chunks, bounded memory):
  msgspec decodes each chunk's run of events, the scanner takes what msgspec does not.

The text is the recorded 8-rank GPU-lab trace (tests/data/kineto_gpu_lab_8rank, rank 0), its
events repeated to ``--mb`` megabytes so the mix of events is a real one. Each reader runs in a
fresh child process (forked after every library was imported, so no reader pays for imports)
with cyclic GC off, as the importer reads (peak RSS measured there, from the child's start);
readers alternate over
``--rounds`` rounds and the median CPU time is printed, with the load average.

    .venv/bin/python bench/kineto_readers.py [--mb 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import multiprocessing
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import orjson
import pyarrow.compute as pc
import pyarrow.json as pj
import simdjson

from comminsight.importers import kineto
from comminsight.importers.columns import paused_gc

RECORDED = Path(__file__).resolve().parent.parent / "tests/data/kineto_gpu_lab_8rank/rank0.pt.trace.json.gz"


def _wanted(event: Any) -> bool:
    if type(event) is not dict or type(name := event.get("name")) is not str:
        return False
    if event.get("cat") == "kernel":
        args = event.get("args")
        return name.startswith("nccl") or (type(args) is dict and "Collective name" in args)
    return name == "record_param_comms" or name.startswith("ProfilerStep#")


def read_json(path: Path) -> int:
    return sum(map(_wanted, json.loads(path.read_bytes())["traceEvents"]))


def read_orjson(path: Path) -> int:
    return sum(map(_wanted, orjson.loads(path.read_bytes())["traceEvents"]))


class _Args(msgspec.Struct, gc=False):
    collective: Any = msgspec.field(default=None, name="Collective name")
    external_id: Any = msgspec.field(default=None, name="External id")


class _Event(msgspec.Struct, gc=False):
    ph: Any = None
    cat: Any = None
    name: Any = None
    ts: Any = None
    dur: Any = None
    pid: Any = None
    args: _Args | None = None


class _Trace(msgspec.Struct, gc=False):
    traceEvents: list[_Event]


def read_msgspec(path: Path) -> int:
    count = 0
    for e in msgspec.json.decode(path.read_bytes(), type=_Trace).traceEvents:
        name = e.name
        if type(name) is str:
            if e.cat == "kernel":
                count += name.startswith("nccl") or (e.args is not None and e.args.collective is not None)
            else:
                count += name == "record_param_comms" or name.startswith("ProfilerStep#")
    return count


def read_simdjson(path: Path) -> int:
    doc = simdjson.Parser().parse(path.read_bytes())
    count = 0
    for e in doc["traceEvents"]:
        name = e.get("name")
        if type(name) is str:
            if e.get("cat") == "kernel":
                args = e.get("args")
                count += name.startswith("nccl") or (args is not None and "Collective name" in args)
            else:
                count += name == "record_param_comms" or name.startswith("ProfilerStep#")
    return count


def read_pyarrow(path: Path) -> int:
    table = pj.read_json(
        path,
        read_options=pj.ReadOptions(block_size=path.stat().st_size + 1),
        parse_options=pj.ParseOptions(newlines_in_values=True),
    )
    events = pc.list_flatten(table.column("traceEvents"))
    name, cat = pc.struct_field(events, "name"), pc.struct_field(events, "cat")
    kernel = pc.and_(pc.equal(cat, "kernel"), pc.starts_with(name, "nccl"))
    other = pc.or_(pc.equal(name, "record_param_comms"), pc.starts_with(name, "ProfilerStep#"))
    return pc.sum(pc.or_(kernel, other)).as_py()


def read_importer(path: Path) -> int:
    with paused_gc():  # as kineto.load reads
        return len(kineto._read(path)["traceEvents"])


def read_scanner(path: Path) -> int:
    kineto._TraceReader._decode_run = lambda self, buf, at=0: None  # every run to the bracket scanner
    with paused_gc():
        return len(kineto._read(path)["traceEvents"])


READERS = {
    "json": read_json,
    "orjson": read_orjson,
    "msgspec": read_msgspec,
    "simdjson": read_simdjson,
    "pyarrow.json": read_pyarrow,
    "scanner": read_scanner,
    "importer": read_importer,
}


def _child(name: str, path: str, queue: Any) -> None:
    gc.disable()  # every reader makes many small objects without cycles: collections only add noise
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.process_time()
    try:
        count: Any = READERS[name](Path(path))
    except Exception as exc:  # reported: a reader that cannot read the document
        count = f"refused ({type(exc).__name__}: {str(exc)[:80]})"
    cpu = time.process_time() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    queue.put((count, cpu, (peak - base) / 1024))


def measure(name: str, path: Path) -> tuple[Any, float, float]:
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(name, str(path), queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def write_text(out: Path, megabytes: float) -> int:
    """The recorded trace with its events repeated to about ``megabytes`` MB; returns its size."""
    trace = json.loads(gzip.decompress(RECORDED.read_bytes()))
    events = trace["traceEvents"]
    block = json.dumps(events, indent=1)[1:-1].encode()
    repeats = max(1, int(megabytes * 1e6 / len(block)))
    head = json.dumps({k: v for k, v in trace.items() if k != "traceEvents"}).encode()[:-1]
    with out.open("wb") as f:
        f.write(head + b', "traceEvents": [')
        f.write(b",".join([block] * repeats))
        f.write(b"]}")
    return out.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=64.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--readers", default=",".join(READERS))
    args = parser.parse_args()
    names = args.readers.split(",")
    with tempfile.TemporaryDirectory(prefix="ci-bench-readers-") as tmp:
        path = Path(tmp) / "rank0.pt.trace.json"
        size = write_text(path, args.mb)
        print(f"text: {size / 1e6:.1f} MB (recorded rank-0 events repeated); load average {os.getloadavg()}")
        cpu: dict[str, list[float]] = {n: [] for n in names}
        mem: dict[str, list[float]] = {n: [] for n in names}
        counts: dict[str, Any] = {}
        for _ in range(args.rounds):
            for name in names:
                count, seconds, peak = measure(name, path)
                counts[name] = count
                if isinstance(count, int):
                    cpu[name].append(seconds)
                    mem[name].append(peak)
        base = statistics.median(cpu["importer"]) if cpu.get("importer") else None
        print(f"{'reader':<14}{'events kept':>12}{'CPU s':>9}{'MB/s':>8}{'peak +MiB':>11}{'vs importer':>13}")
        for name in names:
            if not cpu[name]:
                print(f"{name:<14}{counts[name]}")
                continue
            seconds = statistics.median(cpu[name])
            ratio = f"{seconds / base:.2f}x" if base else ""
            print(
                f"{name:<14}{counts[name]:>12}{seconds:>9.3f}{size / 1e6 / seconds:>8.0f}"
                f"{statistics.median(mem[name]):>11.0f}{ratio:>13}"
            )
        print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
