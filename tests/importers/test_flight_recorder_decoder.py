"""The compiled Flight Recorder decoder: built by set-up, used for plain dumps, and indistinguishable
from the Python reader: the same table, or the same error, for every dump, however odd."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pyarrow as pa
import pytest
from evidence_samples import fr_dump

from comminsight.importers import EvidenceError
from comminsight.importers import flight_recorder as fr


@pytest.fixture
def decoder():
    # `make setup` fails where a C compiler is present and the decoder does not build; a checkout set
    # up before the decoder existed gets it from `make setup` (or `pip install -e ./agent`).
    if fr._frdecode is None:
        pytest.skip("the compiled Flight Recorder decoder is not built here: run `make setup`")
    return fr._frdecode


def _outcome(path: Path) -> pa.Table | str:
    try:
        return fr.load(path)
    except EvidenceError as exc:
        return f"refused: {exc}"


def _both_readers(path: Path, monkeypatch) -> tuple[pa.Table | str, pa.Table | str]:
    compiled = _outcome(path)
    with monkeypatch.context() as patch:
        patch.setattr(fr, "_frdecode", None)
        python = _outcome(path)
    return compiled, python


def _same(compiled: pa.Table | str, python: pa.Table | str) -> None:
    if isinstance(python, str) or isinstance(compiled, str):
        assert compiled == python
    else:
        assert compiled.schema.equals(python.schema, check_metadata=True)
        assert compiled.equals(python)


def test_every_public_dump_is_read_by_the_compiled_decoder(decoder, fr_public):
    dumps = sorted(fr_public.glob("_dump_*"))
    assert len(dumps) == 16
    for path in dumps:
        assert fr._decode(path.read_bytes(), path) is not None, path.name


def test_the_public_dumps_give_the_same_table_from_both_readers(decoder, fr_public, monkeypatch):
    compiled, python = _both_readers(fr_public, monkeypatch)
    _same(compiled, python)
    assert compiled.num_rows > 0


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_dumps_of_every_pickle_protocol_give_the_same_table_from_both_readers(decoder, tmp_path, monkeypatch, protocol):
    for rank in range(3):
        dump = fr_dump(rank, [0, 1, 2], range(40), completed=17)
        entries = dump["entries"]
        entries[3]["profiling_name"] = f"nccl:send {rank}->{(rank + 1) % 3}"
        entries[3]["is_p2p"] = True
        entries[3]["p2p_seq_id"] = 4
        entries[5]["input_sizes"] = [[2, 3], [], [7]]
        entries[6]["input_dtypes"] = ["BFloat16", "c10::Half", "BFloat16"]
        entries[7]["state"] = "completed"
        entries[7]["time_discovered_completed_ns"] = 1 << 62
        entries[8]["process_group"] = ("7", None)
        del entries[9]["state"], entries[9]["input_dtypes"]
        entries[10]["duration_ms"] = 1.25
        (tmp_path / f"_dump_{rank}").write_bytes(pickle.dumps(dump, protocol=protocol))
    assert fr._decode((tmp_path / "_dump_0").read_bytes(), tmp_path / "_dump_0") is not None
    compiled, python = _both_readers(tmp_path, monkeypatch)
    _same(compiled, python)
    assert compiled.num_rows == 3 * 40 + 3


# Values the Python reader takes or refuses in its own ways: each, in one entry of one of two
# dumps, must come out the same from the compiled decoder.
ODD_VALUES = {
    "process_group": [["7"], [7, None], [], None, ("7", 3), "7", [["a"], "b"]],
    "profiling_name": ["nccl:recv 1<-0", None, 5, "", "é:all_reduce", "send 99999999999->1"],
    "is_p2p": [0, 1, None, "", "yes", [0], 2.5],
    "state": ["started", "melted", None, 3],
    "input_sizes": [[], [[]], None, [[True]], [[1.0]], [[-1]], ([4],), [[1 << 40, 1 << 40]], [[1 << 70]], "4x4"],
    "input_dtypes": [[], None, "Float", [1], [None], ("Float",), [["x"]], 0],
    "collective_seq_id": [None, -3, True, 1.0, "3", 1 << 63, (1 << 63) - 1, -(1 << 63)],
    "p2p_seq_id": [None, False, 2.0],
    "record_id": [None, 9.0, 1 << 64],
    "pg_id": [None, True, 3.0, "3", 1 << 65],
    "time_created_ns": [None, 2.5, -(1 << 63) - 1],
}


@pytest.mark.parametrize(
    ("field", "value"),
    [(field, value) for field, values in ODD_VALUES.items() for value in values],
    ids=[f"{field}={value!r:.20}" for field, values in ODD_VALUES.items() for value in values],
)
def test_an_odd_value_in_an_entry_gives_the_same_table_or_error_from_both_readers(
    decoder, tmp_path, monkeypatch, field, value
):
    for rank in range(2):
        dump = fr_dump(rank, [0, 1], range(6), completed=2)
        if rank == 1:
            dump["entries"][4][field] = copy.deepcopy(value)
        (tmp_path / f"_dump_{rank}").write_bytes(pickle.dumps(dump, protocol=2))
    _same(*_both_readers(tmp_path, monkeypatch))


def test_a_dump_with_absent_fields_gives_the_same_table_from_both_readers(decoder, tmp_path, monkeypatch):
    dump = fr_dump(0, [0, 1], range(5), completed=2)
    absent = ("record_id", "pg_id", "profiling_name", "input_sizes", "is_p2p")
    for entry, field in zip(dump["entries"], absent, strict=True):
        del entry[field]
    (tmp_path / "_dump_0").write_bytes(pickle.dumps(dump, protocol=2))
    compiled, python = _both_readers(tmp_path / "_dump_0", monkeypatch)
    assert isinstance(compiled, pa.Table)
    _same(compiled, python)


@pytest.mark.parametrize(
    "body",
    [
        b"\x80\x02}q\x00(X\x07\x00\x00\x00entriesq\x01]q\x02(}q\x03h\x03eu.",  # one entry dict twice
        b"\x80\x02}(X\x07\x00\x00\x00entries](}aeu.",  # APPEND reaching under a MARK
        b"\x80\x02}(X\x07\x00\x00\x00entries]u\x95\xff\x00\x00\x00\x00\x00\x00\x00.",  # a frame past the end
        b"\x80\x02}(]]u.",  # an unhashable key
        b"\x80\x02}(X\x07\x00\x00\x00entries]X\x01\x00\x00\x00\xffu.",  # text that is not UTF-8
        b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00trueq\x85R.",  # a global: code to run
        b"\x80\x02}(X\x07\x00\x00\x00entries](}",  # truncated
    ],
    ids=["shared dict", "append under mark", "frame past end", "unhashable key", "bad utf-8", "global", "truncated"],
)
def test_pickles_the_decoder_declines_are_judged_by_the_python_reader(decoder, tmp_path, monkeypatch, body):
    path = tmp_path / "_dump_0"
    path.write_bytes(body)
    assert decoder.decode(body, fr.MAX_UNPICKLED_BYTES) is None
    compiled, python = _both_readers(path, monkeypatch)
    _same(compiled, python)


def test_a_dump_whose_objects_would_pass_the_memory_bound_is_left_to_the_python_reader(decoder):
    # 3 MB of "new empty dict" opcodes: over 256 MiB of dicts in Python, so over the decoder's own bound.
    body = b"\x80\x02}(X\x07\x00\x00\x00entries](" + b"}" * 3_000_000 + b"eu."
    assert decoder.decode(body, fr.MAX_UNPICKLED_BYTES) is None
    assert decoder.decode(body, 1 << 30) is not None  # the same pickle is plain data


def test_one_declined_dump_sends_its_batch_to_the_python_reader_with_the_same_table(decoder, tmp_path, monkeypatch):
    for rank in range(3):
        dump = fr_dump(rank, [0, 1, 2], range(8), completed=3)
        if rank == 1:
            dump["entries"][2]["input_sizes"] = dump["entries"][1]["input_sizes"]  # shared: declined
        (tmp_path / f"_dump_{rank}").write_bytes(pickle.dumps(dump, protocol=2))
    assert fr._decode((tmp_path / "_dump_1").read_bytes(), tmp_path / "_dump_1") is None
    assert fr._decode((tmp_path / "_dump_0").read_bytes(), tmp_path / "_dump_0") is not None
    _same(*_both_readers(tmp_path, monkeypatch))


def test_a_memo_index_past_the_end_of_the_pickle_is_refused_before_the_unpickler_allocates_for_it(decoder, tmp_path):
    # 40 bytes asking the C unpickler for a memo table of 1.5 G slots (24 GB, zeroed at once).
    body = b"\x80\x02}(X\x07\x00\x00\x00entries]r\x3b\x0c\x05\x58u."
    path = tmp_path / "_dump_0"
    path.write_bytes(body)
    with pytest.raises(EvidenceError, match=r"_dump_0: not a readable Flight Recorder dump: memo index 1476725819"):
        fr.load(path)
