"""Fixed-size C strings in profiler records end at their first NUL: stale bytes after it are not text."""

from __future__ import annotations

import numpy as np

from comminsight.formats import header
from comminsight.importers.archive import _c_strings


def test_a_reused_dtype_buffer_does_not_leak_the_previous_name_into_the_data_type():
    records = np.zeros(2, dtype=header.record_dtype())
    records["dtype"][0] = b"ncclFloat32"
    # The plugin wrote "ncclInt8\0" over "ncclFloat32": the tail "32" is still in the buffer.
    records["dtype"][1] = b"ncclInt8\x0032"
    assert _c_strings(records["dtype"]).tolist() == ["ncclFloat32", "ncclInt8"]
