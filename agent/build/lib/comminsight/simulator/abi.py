"""cffi bindings to native/profiler/include/nccl_profiler_abi.h, the NCCL profiler plugin ABI.

The simulator plays NCCL's side of the ABI: it loads a plugin ``.so``, finds its exported
``ncclProfiler_v5`` (or ``_v4``) table and calls through the function pointers exactly as
NCCL does. The declarations come from the header's NCCL_ABI_CDEF region, never a copy, and
the event-type bits and state numbers from its ``#define`` lines.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import cffi

from comminsight.formats.header import find_include

_HEADER_NAME = "nccl_profiler_abi.h"
ABI_VERSIONS = (4, 5)


def abi_header_path() -> Path:
    """Where the ABI header is ($COMMINSIGHT_ABI_HEADER overrides)."""
    return find_include(_HEADER_NAME, "COMMINSIGHT_ABI_HEADER")


def _parse(text: str) -> tuple[str, dict[str, int]]:
    match = re.search(r"/\* NCCL_ABI_CDEF_BEGIN \*/(.*?)/\* NCCL_ABI_CDEF_END \*/", text, re.S)
    if match is None:
        raise ValueError("header has no NCCL_ABI_CDEF_BEGIN/NCCL_ABI_CDEF_END region")
    constants: dict[str, int] = {}
    for name, shift in re.findall(r"#define\s+(ncclProfile\w+)\s+\(1\s*<<\s*(\d+)\)", text):
        constants[name] = 1 << int(shift)
    for name, value in re.findall(r"#define\s+(ncclProfiler\w+)\s+(\d+)\b", text):
        constants[name] = int(value)
    return match.group(1), constants


@cache
def ffi() -> cffi.FFI:
    """A cffi FFI holding the ABI declarations plus the two exported table symbols."""
    cdef, _ = _parse(abi_header_path().read_text())
    instance = cffi.FFI()
    instance.cdef(cdef)
    # The plugin's exported objects; looked up with ffi.addressof on the dlopen'ed library.
    instance.cdef("extern ncclProfiler_v4_t ncclProfiler_v4; extern ncclProfiler_v5_t ncclProfiler_v5;")
    return instance


@cache
def constants() -> dict[str, int]:
    """Event-type bits (``ncclProfileColl`` ...) and event states (``ncclProfilerKernelChStop`` ...)."""
    return _parse(abi_header_path().read_text())[1]


def event_bit(name: str) -> int:
    """The mask bit of event type ``name`` ("Coll", "KernelCh", ...)."""
    return constants()[f"ncclProfile{name}"]


def event_state(name: str) -> int:
    """The number of event state ``name`` ("KernelChStop", "GroupStartApiStop", ...)."""
    return constants()[f"ncclProfiler{name}"]


@dataclass
class PluginTable:
    """One plugin's ABI table (``ncclProfiler_v4_t*`` or ``ncclProfiler_v5_t*``) and what keeps it alive.

    ``keepalive`` holds the dlopen'ed library or, for in-process fakes, the cffi callbacks: the
    function pointers in ``table`` are valid only while it lives.
    """

    table: Any
    version: int
    keepalive: Any = None

    @property
    def name(self) -> str:
        """The plugin's self-declared name (the table's ``name`` string)."""
        if self.table.name == ffi().NULL:
            return ""
        return ffi().string(self.table.name).decode("utf-8", "replace")

    def descriptor_type(self) -> str:
        """The C type of this version's event descriptor."""
        return f"ncclProfilerEventDescr_v{self.version}_t"

    def state_args_type(self) -> str:
        """The C type of this version's state-args union."""
        return f"ncclProfilerEventStateArgs_v{self.version}_t"


def load_plugin(path: str | os.PathLike[str], version: int = 5) -> PluginTable:
    """dlopen ``path`` and return its ``ncclProfiler_v<version>`` table, as NCCL would find it.

    Raises FileNotFoundError when the file is missing and ValueError when it does not export the
    requested ABI version (NCCL would then fall back to an older symbol or run without a profiler).
    """
    if version not in ABI_VERSIONS:
        raise ValueError(f"unsupported profiler ABI v{version} (supported: {', '.join(map(str, ABI_VERSIONS))})")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"profiler plugin {path} does not exist")
    f = ffi()
    try:
        library = f.dlopen(str(path.resolve()))
    except OSError as error:
        raise ValueError(f"cannot load profiler plugin {path}: {error}") from error
    symbol = f"ncclProfiler_v{version}"
    try:
        table = f.addressof(library, symbol)
    except (AttributeError, KeyError, cffi.FFIError, NotImplementedError) as error:
        raise ValueError(f"{path} does not export {symbol}") from error
    return PluginTable(table=table, version=version, keepalive=library)
