"""JSON from outside the process, parsed with a size and a nesting-depth limit.

Every JSON input that arrives from another machine or a file someone else wrote (archive manifests and
members, the site's API bodies, heartbeats, the agents' cluster reports) goes through ``loads_bounded``.
The standard library's decoder recurses once per nesting level, so a document 200,000 levels deep ends
in ``RecursionError`` — an exception most callers do not expect, which escaped as 500s and as archives
re-queued forever. Here:

* the size is checked first (``max_bytes``), before any parsing;
* orjson parses (its own hard cap is 1,024 levels, reported as a decode error, never a recursion);
* the nesting depth is then measured on the bytes, strings removed, with one vectorised pass
  (``max_depth``), so even a document orjson accepts is refused when it nests deeper than asked.

Every refusal is a ``JSONLimitError`` (a ``ValueError``) whose message names the input and the limit,
in one line, ready for a 400 answer or a quarantine reason. Standard library only plus orjson and numpy:
the agent uses this too and must not import Django.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import orjson

DEFAULT_MAX_BYTES = 8 << 20
DEFAULT_MAX_DEPTH = 32
# A JSON string: quote, then any run of non-quote non-backslash bytes or escaped pairs, then quote.
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
# +1 for each byte that opens an array or object, -1 for each that closes one, 0 otherwise.
_STEP = np.zeros(256, dtype=np.int32)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1


class JSONLimitError(ValueError):
    """JSON that is malformed, too large or nested too deeply; the message says which, in one line."""


def nesting_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in ``data`` (valid JSON): 0 for a scalar."""
    if b"[" not in data and b"{" not in data:
        return 0
    structure = np.frombuffer(_STRING.sub(b"", data), dtype=np.uint8)
    return int(np.cumsum(_STEP[structure]).max(initial=0))


def loads_bounded(
    data: bytes | bytearray | memoryview | str,
    *,
    what: str = "JSON",
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_depth: int = DEFAULT_MAX_DEPTH,
) -> Any:
    """Parse ``data`` as JSON within ``max_bytes`` and ``max_depth``; raises ``JSONLimitError`` otherwise.

    ``what`` names the input in the message (``"manifest.json"``, ``"request body"``).
    """
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if len(raw) > max_bytes:
        raise JSONLimitError(f"{what} is larger than {max_bytes} bytes")
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if "depth" in str(exc) or "recursion" in str(exc).lower():
            raise JSONLimitError(f"{what} nests deeper than {max_depth} levels") from None
        raise JSONLimitError(f"{what} is not valid JSON: {exc}") from None
    if isinstance(value, (dict, list)) and nesting_depth(raw) > max_depth:
        raise JSONLimitError(f"{what} nests deeper than {max_depth} levels")
    return value
