"""The PyTorch import hook: record the process-group table so communicators get their names.

NCCL hands the profiler a communicator hash and, at best, a commName. PyTorch releases
whose NCCL config binding has ``comm_name`` fill it with ``"<group_desc>:<group_name>"``
themselves, and then nothing more is needed. Older releases (2.11 and earlier) leave it
empty, so this hook records, for every process group the job creates, its name, its
description (Megatron-style ``TENSOR_MODEL_PARALLEL_GROUP`` and the like), its member
ranks and its creation order, in ``<home>/metadata/process_groups-<host>-<pid>.json``.
``join_process_groups`` then matches communicators to groups by (member ranks, size,
creation order).

Use it with one line before (or after) ``import torch``::

    import comminsight.torch_hook; comminsight.torch_hook.install()

or start the training script through ``python -m comminsight.torch_hook train.py ...``.
The hook never breaks training: every failure is logged once and swallowed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.util
import json
import logging
import os
import runpy
import socket
import sys
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("comminsight.torch_hook")

_C10D = "torch.distributed.distributed_c10d"
_FORMAT = "comminsight.process_groups"
_lock = threading.Lock()
_state: dict[str, Any] = {"installed": False, "patched": False, "warned": False, "path": None}


def _home() -> Path:
    return Path(os.environ.get("COMMINSIGHT_HOME", "/opt/comminsight"))


def metadata_path(home: Path | None = None) -> Path:
    """Where this process writes its process-group table."""
    home = home if home is not None else _home()
    return home / "metadata" / f"process_groups-{socket.gethostname()}-{os.getpid()}.json"


def _warn_once(message: str, *args: object) -> None:
    if not _state["warned"]:
        _state["warned"] = True
        log.warning(message, *args)


def process_group_table(c10d: Any) -> dict[str, Any]:
    """The current process-group table of ``torch.distributed.distributed_c10d`` as plain data."""
    world = c10d._world
    groups = []
    for index, (group, name) in enumerate(world.pg_names.items()):
        ranks = sorted(world.pg_group_ranks.get(group, {}), key=lambda r: world.pg_group_ranks[group][r])
        desc = getattr(group, "group_desc", "") or ""
        backend = world.pg_map.get(group, (None, None))[0]
        groups.append(
            {
                "name": name,
                "desc": desc,
                "ranks": ranks,
                "size": len(ranks),
                "creation_index": index,
                "backend": str(backend) if backend is not None else None,
            }
        )
    return {
        "format": _FORMAT,
        "version": 1,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "rank": c10d.get_rank() if c10d.is_initialized() else None,
        "world_size": c10d.get_world_size() if c10d.is_initialized() else None,
        "groups": groups,
    }


def record(c10d: Any, home: Path | None = None) -> Path | None:
    """Write the table atomically; returns the path, or None when it could not be written."""
    path = metadata_path(home)
    try:
        table = process_group_table(c10d)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(table, indent=1))
        tmp.replace(path)
        _state["path"] = path
        return path
    except Exception as exc:  # a broken hook must never break training
        _warn_once("comminsight: could not record the process-group table at %s: %s", path, exc)
        return None


def _after(function: Any, c10d: Any) -> Any:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = function(*args, **kwargs)
        record(c10d)
        return result

    wrapper.__comminsight_wrapped__ = True  # type: ignore[attr-defined]
    return wrapper


def _patch(c10d: Any) -> None:
    """Wrap the functions every group creation goes through (init, new_group, split_group)."""
    with _lock:
        if _state["patched"]:
            return
        for name in ("init_process_group", "_new_group_with_tag", "split_group"):
            function = getattr(c10d, name, None)
            if function is None or getattr(function, "__comminsight_wrapped__", False):
                continue
            setattr(c10d, name, _after(function, c10d))
            # torch.distributed re-exports the public ones; keep both names pointing at the wrapper.
            package = sys.modules.get("torch.distributed")
            if package is not None and getattr(package, name, None) is function:
                setattr(package, name, getattr(c10d, name))
        _state["patched"] = True


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches distributed_c10d right after Python executes it, when the hook came first."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if fullname != _C10D:
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
            with contextlib.suppress(Exception):
                _patch(module)

        spec.loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Install the hook (idempotent). Safe to call before or after ``import torch``."""
    if _state["installed"]:
        return
    _state["installed"] = True
    try:
        module = sys.modules.get(_C10D)
        if module is not None:
            _patch(module)
        else:
            sys.meta_path.insert(0, _PatchOnImport())
    except Exception as exc:
        _warn_once("comminsight: import hook not installed: %s", exc)


def join_process_groups(communicators: Iterable[dict[str, Any]], tables: Iterable[dict[str, Any]]) -> dict[str, dict]:
    """Name communicators from recorded process-group tables.

    ``communicators``: dicts with ``comm_id``, ``ranks`` (global member ranks, any order) and
    optionally ``first_seen_ns``. ``tables``: recorded tables (one per process). A group
    matches a communicator when their member sets are equal; when several groups share a
    member set (the same ranks split twice), they are paired in creation order with the
    communicators in first-seen order. Returns ``{comm_id: {"name", "desc", "ranks"}}``.
    """
    groups: dict[tuple[int, ...], list[dict]] = {}
    seen: set[tuple[tuple[int, ...], int]] = set()
    for table in tables:
        for group in table.get("groups", []):
            members = tuple(sorted(int(r) for r in group.get("ranks", [])))
            key = (members, int(group.get("creation_index", 0)))
            if not members or key in seen:
                continue
            seen.add(key)
            groups.setdefault(members, []).append(group)
    for candidates in groups.values():
        candidates.sort(key=lambda g: g.get("creation_index", 0))
    by_members: dict[tuple[int, ...], list[dict]] = {}
    for communicator in communicators:
        by_members.setdefault(tuple(sorted(communicator["ranks"])), []).append(communicator)
    names: dict[str, dict] = {}
    for members, comms in by_members.items():
        comms.sort(key=lambda c: c.get("first_seen_ns") or 0)
        for communicator, group in zip(comms, groups.get(members, []), strict=False):
            names[communicator["comm_id"]] = {"name": group["name"], "desc": group["desc"], "ranks": list(members)}
    return names


def load_tables(home: Path) -> list[dict[str, Any]]:
    """Every well-formed process-group table under ``<home>/metadata``; malformed files are skipped with a warning."""
    tables = []
    for path in sorted((Path(home) / "metadata").glob("process_groups-*.json")):
        try:
            if path.stat().st_size > 16 << 20:
                raise ValueError("larger than 16 MiB")
            table = json.loads(path.read_text())
            if (
                not isinstance(table, dict)
                or table.get("format") != _FORMAT
                or not isinstance(table.get("groups"), list)
            ):
                raise ValueError("not a process-group table")
            tables.append(table)
        except (OSError, ValueError) as exc:
            log.warning("skipping %s: %s", path, exc)
    return tables


def main(argv: list[str] | None = None) -> None:
    """``python -m comminsight.torch_hook script.py [args...]``: run a script with the hook installed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        sys.exit("usage: python -m comminsight.torch_hook SCRIPT [ARGS...]")
    install()
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
