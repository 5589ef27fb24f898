"""Step templates: the documented TOML format, user templates, and malformed files."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
import synthetic

from comminsight.semantic import TemplateError, builtin_templates, load_template, parse_template, recover_steps

USER_TEMPLATE = """
name = "my-ddp"
description = "gradient all-reduces of at least 1 MiB open the step after any small all-reduce"
min_run = 1
requires = ["small"]

[[tokens]]
name = "small"
class = "end"
ops = ["all_reduce"]
max_bytes = 64

[[tokens]]
name = "grad"
class = "start"
ops = ["all_reduce"]
min_bytes = 1048576
"""


def test_builtin_templates_cover_ddp_fsdp_and_megatron() -> None:
    assert [t.name for t in builtin_templates()] == ["megatron", "fsdp", "ddp"]


def test_a_user_template_is_used_when_it_fits(tmp_path) -> None:
    path = tmp_path / "my.toml"
    path.write_text(USER_TEMPLATE)
    df = pl.from_arrow(synthetic.table("ddp", seed=4))
    truth = df.get_column("step").to_numpy()
    report = recover_steps(df.with_columns(step=pl.lit(None, dtype=pl.Int64)), templates=[load_template(path)])
    assert report.method == "my-ddp"
    recovered = np.full(df.height, -2)
    recovered[report.event_rows] = report.event_steps
    assert np.array_equal(recovered, truth)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("name = ", "not valid TOML"),
        ('name = "x"\nsurprise = 1\n[[tokens]]\nname="a"\nclass="start"\n', "unknown keys"),
        ('[[tokens]]\nname="a"\nclass="start"\n', "'name'"),
        ('name = "x"\n', "'tokens'"),
        ('name = "x"\n[[tokens]]\nname="a"\nclass="end"\n', "class 'start'"),
        ('name = "x"\n[[tokens]]\nname="a"\nclass="start"\nops=["allreduce"]\n', "unknown"),
        ('name = "x"\n[[tokens]]\nname="a"\nclass="start"\nroles=["gpu"]\n', "unknown"),
        ('name = "x"\n[[tokens]]\nname="a"\nclass="start"\nmin_bytes=-1\n', "whole number"),
        ('name = "x"\nmin_run = 0\n[[tokens]]\nname="a"\nclass="start"\n', "min_run"),
        ('name = "x"\nrequires = ["b"]\n[[tokens]]\nname="a"\nclass="start"\n', "unknown"),
        ('name = "x"\n' + "[[tokens]]\nname='a'\nclass='start'\n" * 65, "1 to 64"),
        ('name = "x"\n#' + "a" * 70_000, "larger than"),
    ],
)
def test_malformed_templates_are_refused_with_a_clear_error(text: str, message: str) -> None:
    with pytest.raises(TemplateError, match=message):
        parse_template(text)


def test_template_files_that_cannot_be_read_are_refused(tmp_path) -> None:
    with pytest.raises(TemplateError):
        load_template(tmp_path / "absent.toml")
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"\xff\xfe\x00name")
    with pytest.raises(TemplateError):
        load_template(binary)
