"""The cffi/numpy bindings of the ring header (the contract with the profiler)."""

from __future__ import annotations

import numpy as np

from comminsight.formats import header


def test_record_layout_matches_the_c_header():
    dtype = header.record_dtype()
    assert dtype.itemsize == header.constants()["CI_RECORD_SIZE"] == 256
    assert header.struct_dtype("ci_ring_header").fields["tail"][1] % 64 == 0  # own cache line


def test_a_record_changed_after_sealing_no_longer_verifies():
    records = np.zeros(3, header.record_dtype())
    records["func"] = b"AllReduce"
    records["seq"] = [1, 2, 3]
    header.seal_records(records)
    assert header.valid_records(records).all()
    records["seq"][1] = 99
    assert header.valid_records(records).tolist() == [True, False, True]


def test_an_empty_batch_has_no_valid_records():
    assert header.valid_records(np.zeros(0, header.record_dtype())).shape == (0,)


def test_records_become_arrow_columns_with_strings_decoded():
    records = np.zeros(1, header.record_dtype())
    records["comm_name"] = b"tp-group"
    table = header.records_to_arrow(records)
    assert table.column("comm_name").to_pylist() == ["tp-group"]
    assert "magic" not in table.column_names
