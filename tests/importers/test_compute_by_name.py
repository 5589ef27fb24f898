"""comminsight.evidence.compute gives what pyarrow.compute gives, nulls and chunks included.

The importers call Arrow's compute functions by name to stay off ``pyarrow.compute``'s import; these
compare each with its namesake on arrays with nulls, chunked arrays and a table, so that a pyarrow
upgrade that changes a default shows here rather than in a report."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from comminsight.evidence import compute

INTS = pa.array([3, None, 0, 7], pa.int32())
BOOLS = pa.array([True, None, False, True])
NAMES = pa.chunked_array([["nccl:all_reduce", None], ["send", "ProfilerStep#4", "recv"]])


def same(ours: object, theirs: object) -> None:
    assert type(ours) is type(theirs)
    kind = "schema" if isinstance(theirs, pa.Table) else "type"
    assert getattr(ours, kind) == getattr(theirs, kind)
    assert ours.equals(theirs)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("and_", (BOOLS, pa.array([True, True, None, False]))),
        ("coalesce", (INTS, pa.array([1, 1, None, 1], pa.int32()))),
        ("dictionary_encode", (NAMES,)),
        ("equal", (NAMES, "send")),
        ("if_else", (BOOLS, INTS, pa.scalar(-1, pa.int32()))),
        ("invert", (BOOLS,)),
        ("is_null", (pa.array([1.0, None, float("nan")]),)),
        ("is_valid", (NAMES,)),
        ("multiply_checked", (INTS, 1000)),
        ("take", (INTS, pa.array([3, None, 0]))),
        ("unique", (NAMES,)),
    ],
)
def test_each_function_by_name_gives_what_pyarrow_compute_gives(name, args):
    same(getattr(compute, name)(*args), getattr(pc, name)(*args))


def test_take_of_a_table_and_out_of_bounds_indices_as_pyarrow_compute():
    table = pa.table({"rank": INTS, "ok": BOOLS})
    same(compute.take(table, pa.array([2, 0])), pc.take(table, pa.array([2, 0])))
    with pytest.raises(IndexError):
        compute.take(INTS, pa.array([4]))


@pytest.mark.parametrize("fill", [0, pa.scalar(0, pa.int64()), pa.scalar(5, pa.int8())])
def test_fill_null_gives_the_values_type_whatever_the_fill_value(fill):
    same(compute.fill_null(INTS, fill), pc.fill_null(INTS, fill))
    assert compute.fill_null(INTS, fill).type == pa.int32()


def test_is_in_starts_with_and_cast_as_pyarrow_compute():
    value_set = pa.array(["send", "recv"])
    same(compute.is_in(NAMES, value_set), pc.is_in(NAMES, value_set=value_set))
    same(compute.is_in(NAMES, pa.array(["send", None])), pc.is_in(NAMES, value_set=pa.array(["send", None])))
    same(compute.starts_with(NAMES, "ProfilerStep#"), pc.starts_with(NAMES, "ProfilerStep#"))
    same(compute.cast(INTS, pa.int64()), pc.cast(INTS, pa.int64()))
    with pytest.raises(pa.ArrowInvalid):  # lossy: refused, as Array.cast refuses by default
        compute.cast(pa.array([300]), pa.int8())
