"""The streaming Kineto reader gives exactly the table of the whole document parsed at once.

The reference parses the whole trace with the standard library and maps every event; the
importer reads pieces, parses only the events that can matter, and keeps only their useful
fields. Traces are generated (a realistic mix of events) and bent into the awkward forms JSON
allows: escapes that spell the names, brackets and quotes inside strings, NaN, huge integers,
non-object elements, a repeated traceEvents key, and chunk boundaries anywhere.
"""

from __future__ import annotations

import gzip
import itertools
import json
import random
import zlib
from pathlib import Path

import pyarrow as pa
import pytest
from evidence_samples import kineto_trace

from comminsight.importers import EvidenceError, kineto
from comminsight.importers.columns import concat


def _reference(path: Path) -> pa.Table:
    """The trace parsed whole by ``json.loads``, then mapped."""
    text = path.read_bytes()
    return concat([kineto._load_one(path, json.loads(text))])


def _escape_all(text: str) -> str:
    return "".join(f"\\u{ord(c):04x}" for c in text)


def _awkward(trace: dict, seed: int) -> str:
    """The trace as JSON text with every awkward form a parser must get right."""
    rng = random.Random(seed)
    events = trace["traceEvents"]
    for i, event in enumerate(events):
        roll = rng.random()
        if roll < 0.05:
            event["args"] = {**event.get("args", {}), "note": 'a "quoted" ]} [{ text \\ with, brackets'}
        elif roll < 0.07:
            event["args"] = {**event.get("args", {}), "nested": [[{"a": [1, {"b": [2]}]}]]}
        elif roll < 0.08:
            events[i] = rng.choice([5, "nccl", [1, 2], None])
    text = json.dumps(trace, indent=rng.choice([None, 1]))
    # Names spelled with \u escapes, which read the same once parsed.
    text = text.replace('"record_param_comms"', '"' + _escape_all("record_param_comms") + '"', 3)
    text = text.replace('"kernel"', '"' + _escape_all("kernel") + '"', 3)
    text = text.replace('"ProfilerStep#1"', '"' + _escape_all("ProfilerStep#1") + '"')
    # NaN and an integer past 64 bits, which only the standard parser admits.
    text = text.replace('"dur": 3.5', '"dur": NaN', 5)
    text = text.replace('"Sequence number": 7,', '"Sequence number": 123456789012345678901234567890,')
    return text


@pytest.mark.parametrize("chunk", [64 << 10, 4099, 8 << 20])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_streamed_table_equals_the_whole_document_reference(tmp_path, monkeypatch, chunk, seed):
    monkeypatch.setattr(kineto, "CHUNK_BYTES", chunk)
    path = tmp_path / f"rank{seed}.pt.trace.json"
    path.write_text(_awkward(kineto_trace(seed, 4, 3000, seed=seed, nccl_every=7), seed))
    streamed = kineto.load(path)
    assert streamed.num_rows > 0
    assert streamed.equals(_reference(path))


def test_the_last_trace_events_key_wins_as_in_a_whole_document_parse(tmp_path):
    first = kineto_trace(0, 2, 10)  # one step
    second = kineto_trace(0, 2, 3000, seed=5)  # four
    text = json.dumps(first)[:-1] + ', "traceEvents": ' + json.dumps(second["traceEvents"]) + "}"
    path = tmp_path / "rank0.json"
    path.write_text(text)
    table = kineto.load(path)
    assert table.equals(_reference(path))
    assert table.num_rows > kineto.load(_write(tmp_path / "rank0a.json", first)).num_rows


def _write(path: Path, trace: dict) -> Path:
    path.write_text(json.dumps(trace))
    return path


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"schemaVersion": 1, "traceEvents": [{"name": "x"}]', "not valid JSON"),
        ('{"schemaVersion": 1, "traceEvents": [{"name": "x"}]}}', "never opened"),
        ('{"schemaVersion": 1, "traceEvents": [{"name": "nccl", "ts": tru}]}', "not valid JSON"),
        ('{"schemaVersion": 1, "traceEvents": [{"name": "x"}}', "traceEvents closes"),
        ('{"schemaVersion": 1, "traceEvents": {"a": 1}}', "no 'traceEvents' list"),
        ('{"schemaVersion": 1, "traceEvents": []} {"more": 1}', "not valid JSON"),
    ],
)
def test_broken_documents_are_refused_with_the_reason(tmp_path, text, message):
    path = tmp_path / "rank0.json"
    path.write_text(text)
    with pytest.raises(EvidenceError, match=message):
        kineto.load(path)


def _late_oddities(trace: dict) -> str:
    """The trace as text, with the forms the msgspec run decoder must hand to the scanner (or read as
    the whole-document parse does) placed in the last third of the events, where runs are decoded."""
    events = trace["traceEvents"]
    late = len(events) * 2 // 3
    kernels = [i for i in range(late, len(events)) if events[i].get("cat") == "kernel"]
    compute = [i for i in kernels if not events[i]["name"].startswith("nccl")]
    nccl = [i for i in kernels if events[i]["name"].startswith("nccl")]
    # A compute kernel whose args name a collective: taken as one (its key spelled with escapes below).
    events[compute[0]]["args"] = {**events[compute[0]]["args"], "Collective name": "broadcast"}
    # Text that reads like an event boundary and an NCCL kernel, inside a string and inside nested args.
    fake = '}, {"ph": "X", "cat": "kernel", "name": "ncclKernel_Fake", "ts": 1, "args": {"Collective name": "x"}}, {'
    events[compute[1]]["args"] = {**events[compute[1]]["args"], "note": fake}
    events[compute[2]]["args"] = {**events[compute[2]]["args"], "list": [{"a": 1}, {"b": [{"c": 2}]}]}
    events[nccl[0]]["args"] = "not an object"  # kept as it is; the table reads no args from it
    events.insert(nccl[1], 17)  # an element that is not an object
    text = json.dumps(trace, indent=1)
    text = text.replace('"Collective name": "broadcast"', '"' + _escape_all("Collective name") + '": "broadcast"')
    # A duration past the float range, which only the standard parser admits (as infinity).
    marker = json.dumps(events[nccl[2]]["dur"])
    return text.replace(f'"dur": {marker}', '"dur": 1e400', 1)


@pytest.mark.parametrize("chunk", [4099, 64 << 10])
def test_runs_decoded_by_msgspec_read_as_the_whole_document_does(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(kineto, "CHUNK_BYTES", chunk)
    decoded = []
    run = kineto._TraceReader._decode_run
    monkeypatch.setattr(
        kineto._TraceReader, "_decode_run", lambda self, buf, at=0: decoded.append(run(self, buf, at)) or decoded[-1]
    )
    path = tmp_path / "rank0.pt.trace.json"
    path.write_text(_late_oddities(kineto_trace(0, 4, 6000, seed=3, nccl_every=7)))
    table = kineto.load(path)
    assert table.equals(_reference(path))
    assert "broadcast" in table.column("op").to_pylist()  # the kernel whose args name it, with escapes
    # Most runs were decoded by msgspec, and the oddities sent some to the scanner.
    assert sum(d is not None for d in decoded) > len(decoded) // 2
    assert None in decoded


def _gzipped_in_members(path: Path, text: bytes, members: int) -> Path:
    """``text`` as several gzip members back to back (as concatenated .gz files are)."""
    cut = [len(text) * i // members for i in range(members + 1)]
    path.write_bytes(b"".join(gzip.compress(text[a:b], 6, mtime=0) for a, b in itertools.pairwise(cut)))
    return path


@pytest.mark.parametrize("chunk", [4099, 8 << 20])
def test_a_gzip_trace_reads_the_same_with_isal_as_with_the_zlib_module(tmp_path, monkeypatch, chunk):
    isal_zlib = pytest.importorskip("isal.isal_zlib")
    monkeypatch.setattr(kineto, "CHUNK_BYTES", chunk)
    text = _awkward(kineto_trace(1, 4, 3000, seed=1, nccl_every=7), 1).encode()
    path = _gzipped_in_members(tmp_path / "rank1.pt.trace.json.gz", text, 3)
    monkeypatch.setattr(kineto, "_inflate", isal_zlib)
    fast = kineto.load(path)
    monkeypatch.setattr(kineto, "_inflate", zlib)
    assert fast.num_rows > 0
    assert fast.equals(kineto.load(path))
    assert fast.equals(_reference(_write_bytes(tmp_path / "rank1.json", text)))


def _write_bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("damage", ["checksum", "data"])
def test_a_corrupt_gzip_trace_is_refused_with_the_reason(tmp_path, damage):
    text = json.dumps(kineto_trace(0, 4, 3000, seed=2, nccl_every=7)).encode()
    data = bytearray(gzip.compress(text, 6, mtime=0))
    # Past the first 4 KiB of text (what detection reads), so the file is still taken for a trace.
    data[-6 if damage == "checksum" else len(data) * 2 // 3] ^= 0x5A
    path = _write_bytes(tmp_path / "rank0.pt.trace.json.gz", bytes(data))
    assert kineto.detect(path)
    with pytest.raises(EvidenceError, match="corrupt gzip data"):
        kineto.load(path)
