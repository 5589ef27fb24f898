"""``comminsight import``: writes the conformed table atomically, refuses bad input without leftovers."""

from __future__ import annotations

import json
import pickle

import pyarrow.parquet as pq
from evidence_samples import fr_dump
from typer.testing import CliRunner

from comminsight.cli import app
from comminsight.evidence import SCHEMA


def test_import_writes_the_operations_table_that_analyses_read_back(fr_public, tmp_path):
    out = tmp_path / "out" / "ops.parquet"
    result = CliRunner().invoke(app, ["import", str(fr_public), "-o", str(out)])
    assert result.exit_code == 0, result.output
    table = pq.read_table(out)
    assert table.schema.equals(SCHEMA, check_metadata=False)
    assert table.num_rows > 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["ops.parquet"]
    analysed = CliRunner().invoke(app, ["analyze", "hang", str(out), "--format", "json"])
    assert analysed.exit_code == 0, analysed.output
    assert json.loads(analysed.output)["verdict"] == "hang"


def test_import_of_bad_input_exits_non_zero_and_leaves_no_file(tmp_path):
    bad = tmp_path / "_dump_0"
    dump = fr_dump(0, [0, 1], range(3))
    dump["entries"][0]["state"] = "exploded"
    bad.write_bytes(pickle.dumps(dump))
    out = tmp_path / "out.parquet"
    result = CliRunner().invoke(app, ["import", str(bad), "-o", str(out)])
    assert result.exit_code == 2
    assert "unknown state" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["_dump_0"]


def test_import_keeps_an_existing_output_when_the_new_import_fails(tmp_path, fr_public):
    out = tmp_path / "ops.parquet"
    assert CliRunner().invoke(app, ["import", str(fr_public), "-o", str(out)]).exit_code == 0
    before = out.read_bytes()
    result = CliRunner().invoke(app, ["import", str(tmp_path / "missing"), "-o", str(out)])
    assert result.exit_code == 2
    assert "no such file" in result.output
    assert out.read_bytes() == before


def test_import_with_an_unknown_or_wrong_format_fails_clearly(fr_public, tmp_path):
    out = tmp_path / "o.parquet"
    result = CliRunner().invoke(app, ["import", str(fr_public), "-o", str(out), "--format", "nope"])
    assert result.exit_code == 2
    assert "unknown format" in result.output
    result = CliRunner().invoke(app, ["import", str(fr_public), "-o", str(out), "--format", "kineto"])
    assert result.exit_code == 2
    assert "no Kineto trace" in result.output
    assert not out.exists()
