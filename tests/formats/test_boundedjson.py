"""One bounded JSON parser for every input from outside: size and depth limits, one-line refusals."""

from __future__ import annotations

import json

import pytest

from comminsight.formats.boundedjson import JSONLimitError, loads_bounded, nesting_depth


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def test_ordinary_documents_parse_as_the_standard_library_would():
    document = {"ranks": list(range(1000)), "name": 'a "quoted" [not a bracket] {nor this}', "n": None}
    assert loads_bounded(json.dumps(document)) == document
    assert loads_bounded(b"3") == 3


@pytest.mark.parametrize("depth", [33, 1025, 200_000])
def test_documents_nested_deeper_than_the_limit_are_refused_without_recursion(depth):
    with pytest.raises(JSONLimitError, match=r"manifest\.json nests deeper than 32 levels"):
        loads_bounded(nested(depth), what="manifest.json", max_depth=32)


def test_the_depth_limit_is_exact():
    assert loads_bounded(nested(32), max_depth=32) == loads_bounded(nested(32), max_depth=100)
    with pytest.raises(JSONLimitError):
        loads_bounded(nested(4), max_depth=3)


def test_brackets_inside_strings_do_not_count_as_nesting():
    assert nesting_depth(b'{"a": "[[[[[[\\"[[[", "b": [1]}') == 2
    assert loads_bounded('["' + "[" * 100 + '"]', max_depth=1) == ["[" * 100]


def test_a_document_over_the_size_limit_is_refused_before_parsing():
    with pytest.raises(JSONLimitError, match="request body is larger than 10 bytes"):
        loads_bounded(b"[" + b"1," * 100 + b"1]", what="request body", max_bytes=10)


@pytest.mark.parametrize("data", [b"", b'{"a":', b"\xff\xfe", b"NaN", b"[1,]"])
def test_malformed_json_is_one_refusal_on_one_line(data):
    with pytest.raises(JSONLimitError, match="is not valid JSON") as refused:
        loads_bounded(data, what="hang/x.json")
    assert "\n" not in str(refused.value)
