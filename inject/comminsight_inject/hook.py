"""The deferred import hook: name every process group's NCCL communicator, decided at run time.

Three levels, chosen once ``torch.distributed`` is imported (``naming_level``):

1. PyTorch's NCCL config binding (``ProcessGroupNCCL.NCCLConfig``) has ``comm_name``: every group
   created without an explicit name gets ``"<group_desc>:<group_name>"``, which NCCL hands to the
   profiler with every operation. The table of level 2 is recorded as well (it costs nothing and
   survives where a name does not travel, e.g. into the site's communicator rows).
2. Otherwise the process-group table (name, desc, global member ranks, creation order) is written
   to ``<home>/metadata/process_groups-<host>-<pid>.json`` after each group creation, and the
   agent, the importers and the site join it to communicators.
3. Otherwise (the PyTorch internals the hook relies on are missing): nothing is patched; a table
   with no groups and the reason is written when the home allows, so reports can say why names are
   unavailable.

Nothing here may break training: every failure is logged once (logger ``comminsight.inject``) and
swallowed. Format of the table: docs/torch-hook.md (``comminsight.process_groups``, version 1).
"""

from __future__ import annotations

import copy
import functools
import importlib.abc
import importlib.util
import json
import logging
import os
import socket
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("comminsight.inject")

C10D = "torch.distributed.distributed_c10d"
FORMAT = "comminsight.process_groups"
VERSION = 1
# Functions every group creation goes through; their completion is when the table is rewritten.
_RECORD_AFTER = ("init_process_group", "_new_group_with_tag", "split_group")
_HELPER = "_new_process_group_helper"

_lock = threading.Lock()
_state: dict[str, Any] = {"installed": False, "patched": False, "warned": False, "path": None, "level": None}


def home() -> Path:
    return Path(os.environ.get("COMMINSIGHT_HOME", "/opt/comminsight"))


def metadata_path(root: Path | None = None) -> Path:
    """Where this process writes its process-group table."""
    root = root if root is not None else home()
    return root / "metadata" / f"process_groups-{socket.gethostname()}-{os.getpid()}.json"


def warn_once(message: str, *args: object) -> None:
    """The one warning a process gives; later failures stay silent (training must not drown in them)."""
    if not _state["warned"]:
        _state["warned"] = True
        log.warning(message, *args)


def naming_level(c10d: Any = None) -> tuple[int, str]:
    """(level, why) for the PyTorch importable here; ``c10d`` is ``torch.distributed.distributed_c10d``."""
    try:
        if c10d is None:
            import torch.distributed.distributed_c10d as c10d
    except Exception as exc:
        return 3, f"torch.distributed is not importable ({exc.__class__.__name__}: {exc})"
    missing = [name for name in (_HELPER, "_world", *_RECORD_AFTER[:2]) if not hasattr(c10d, name)]
    if missing:
        return 3, f"this PyTorch's distributed_c10d lacks {', '.join(missing)}: the hook cannot follow group creation"
    nccl = getattr(c10d, "ProcessGroupNCCL", None)
    if nccl is None:
        return 2, "this PyTorch is built without NCCL: process-group table only"
    config = getattr(nccl, "NCCLConfig", None)
    if config is not None and hasattr(config, "comm_name"):
        return 1, "ProcessGroupNCCL.NCCLConfig has comm_name: NCCL receives '<group_desc>:<group_name>'"
    return 2, "ProcessGroupNCCL.NCCLConfig has no comm_name: process-group table joined by the agent"


def process_group_table(c10d: Any) -> dict[str, Any]:
    """The current process-group table of ``distributed_c10d`` as plain data (format version 1)."""
    world = c10d._world
    groups = []
    for index, (group, name) in enumerate(world.pg_names.items()):
        positions = world.pg_group_ranks.get(group, {})
        ranks = sorted(positions, key=lambda r: positions[r])
        backend = world.pg_map.get(group, (None, None))[0]
        groups.append(
            {
                "name": str(name),
                "desc": str(getattr(group, "group_desc", "") or ""),
                "ranks": [int(r) for r in ranks],
                "size": len(ranks),
                "creation_index": index,
                "backend": str(backend) if backend is not None else None,
            }
        )
    initialised = c10d.is_initialized()
    return {
        "format": FORMAT,
        "version": VERSION,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "rank": c10d.get_rank() if initialised else None,
        "world_size": c10d.get_world_size() if initialised else None,
        "level": _state["level"],
        "reason": _state.get("reason", ""),
        "groups": groups,
    }


def write_table(table: dict[str, Any], root: Path | None = None) -> Path | None:
    """Write ``table`` as this process's table under ``root`` (default: the home), atomically; None on failure."""
    path = metadata_path(root)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(table, indent=1))
        tmp.replace(path)
        _state["path"] = path
        return path
    except Exception as exc:  # a broken hook must never break training
        warn_once("comminsight: could not record the process-group table at %s: %s", path, exc)
        return None


def record(c10d: Any, root: Path | None = None) -> Path | None:
    """Write the table atomically; returns the path, or None when it could not be written."""
    try:
        table = process_group_table(c10d)
    except Exception as exc:
        warn_once("comminsight: could not read the process-group table: %s", exc)
        return None
    return write_table(table, root)


def _record_after(function: Any, c10d: Any) -> Any:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = function(*args, **kwargs)
        record(c10d)
        return result

    wrapper.__comminsight_wrapped__ = True  # type: ignore[attr-defined]
    return wrapper


def _named_options(c10d: Any, options: Any, group_name: Any, group_desc: Any, timeout: Any) -> Any:
    """NCCL options carrying ``"<group_desc>:<group_name>"`` unless the caller named the group already."""
    nccl = c10d.ProcessGroupNCCL
    if options is None:
        options = nccl.Options()
        options.is_high_priority_stream = False
        if timeout is not None:
            options._timeout = timeout  # what PyTorch would set; avoids its "timeout overridden" warning
    elif not isinstance(options, nccl.Options):
        return options
    else:
        if getattr(options.config, "comm_name", None):
            return options  # an explicit name wins
        options = copy.deepcopy(options)  # callers reuse one options object for many groups
    options.config.comm_name = f"{group_desc or 'undefined'}:{group_name}"
    return options


def _name_communicators(helper: Any, c10d: Any) -> Any:
    """Level 1: wrap ``_new_process_group_helper`` so NCCL groups get a commName."""

    @functools.wraps(helper)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = _signature_of(helper).bind(*args, **kwargs)
            backend = str(bound.arguments.get("backend", "")).lower()
            if "nccl" in backend:
                bound.arguments["backend_options"] = _named_options(
                    c10d,
                    bound.arguments.get("backend_options"),
                    bound.arguments.get("group_name"),
                    bound.arguments.get("group_desc"),
                    bound.arguments.get("timeout"),
                )
                args, kwargs = bound.args, bound.kwargs
        except Exception as exc:
            warn_once("comminsight: could not name an NCCL communicator (the table is still recorded): %s", exc)
        return helper(*args, **kwargs)

    wrapper.__comminsight_wrapped__ = True  # type: ignore[attr-defined]
    return wrapper


def _signature_of(function: Any) -> Any:
    import inspect  # only level 1 needs it, and every interpreter start imports this module

    return inspect.signature(function)


def patch(c10d: Any) -> int:
    """Patch ``distributed_c10d`` for the level that applies; returns that level (idempotent)."""
    with _lock:
        if _state["patched"]:
            return int(_state["level"])
        level, why = naming_level(c10d)
        _state["level"], _state["reason"] = level, why
        _state["patched"] = True
        if level == 3:
            warn_once("comminsight: communicator names unavailable: %s", why)
            write_table({**empty_table(), "level": 3, "reason": why})
            return level
        if level == 1:
            helper = getattr(c10d, _HELPER)
            if not getattr(helper, "__comminsight_wrapped__", False):
                setattr(c10d, _HELPER, _name_communicators(helper, c10d))
        package = sys.modules.get("torch.distributed")
        for name in _RECORD_AFTER:
            function = getattr(c10d, name, None)
            if function is None or getattr(function, "__comminsight_wrapped__", False):
                continue
            setattr(c10d, name, _record_after(function, c10d))
            # torch.distributed re-exports the public ones; keep both names pointing at the wrapper.
            if package is not None and getattr(package, name, None) is function:
                setattr(package, name, getattr(c10d, name))
        log.debug("comminsight: naming level %d (%s)", level, why)
        return level


def empty_table() -> dict[str, Any]:
    """A table of this process with no groups (filled by callers that know their groups, e.g. the simulator)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "rank": None,
        "world_size": None,
        "groups": [],
    }


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches distributed_c10d right after Python executes it, when the hook came first."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if fullname != C10D:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module: Any) -> None:
            exec_module(module)
            try:
                patch(module)
            except Exception as exc:
                warn_once("comminsight: import hook failed; names unavailable: %s", exc)

        spec.loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Install the hook (idempotent). Safe before or after ``import torch``; never raises."""
    if _state["installed"]:
        return
    _state["installed"] = True
    try:
        module = sys.modules.get(C10D)
        if module is not None:
            patch(module)
        else:
            sys.meta_path.insert(0, _PatchOnImport())
    except Exception as exc:
        warn_once("comminsight: import hook not installed: %s", exc)


def current_level() -> int | None:
    """The level this process applied, once torch.distributed was imported (None before)."""
    return _state["level"]
