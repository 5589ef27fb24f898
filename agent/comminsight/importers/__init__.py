"""Importers: turn evidence users already hold into the operations table (comminsight.evidence).

Each importer module registers one ``Importer``: a name, a ``detect(path) -> bool`` that
looks only at names and the first bytes, and a ``load(path) -> pa.Table`` that returns a
conformed operations table or raises ``ImportError_`` with a message a user can act on.
``load(path)`` picks the first importer whose detector accepts the path. Importers are
all-or-nothing: a load either returns the whole table or raises; it never writes anything.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import import_module
from itertools import islice
from pathlib import Path

import pyarrow as pa


class EvidenceError(ValueError):
    """Evidence that cannot be imported; the message says which file and why."""


@dataclass(frozen=True)
class Importer:
    name: str
    detect: Callable[[Path], bool]
    load: Callable[[Path], pa.Table]


_REGISTRY: dict[str, Importer] = {}

# Modules that register built-in importers, in detection order (most specific first).
_BUILTIN_MODULES = (
    "comminsight.importers.archive",
    "comminsight.importers.rawlog",
    "comminsight.importers.flight_recorder",
    "comminsight.importers.kineto",
    "comminsight.importers.nccl_inspector",
    "comminsight.importers.table",
)


# A directory of evidence holds one file per rank (or a few segments per process): 65,536 is far
# beyond any job we know, and keeps a hostile directory from being listed without end.
MAX_DIRECTORY_ENTRIES = 65536
# Detection looks at this many candidate files at most.
DETECT_SAMPLE = 256


def _candidates(directory: Path) -> Iterator[Path]:
    """Regular, non-hidden files of ``directory`` in name order, refusing directories over the cap."""
    entries = []
    with os.scandir(directory) as scan:
        for entry in scan:
            entries.append(entry)
            if len(entries) > MAX_DIRECTORY_ENTRIES:
                raise EvidenceError(
                    f"{directory}: more than {MAX_DIRECTORY_ENTRIES} entries; import a smaller directory"
                )
    for entry in sorted(entries, key=lambda e: e.name):
        if not entry.name.startswith(".") and entry.is_file(follow_symlinks=False):
            yield Path(entry.path)


def evidence_files(path: Path, accept: Callable[[Path], bool]) -> list[Path]:
    """``[path]`` for a file; for a directory, its files that ``accept`` recognises (capped, name order)."""
    if path.is_file():
        return [path]
    return [candidate for candidate in _candidates(path) if accept(candidate)]


def directory_holds(path: Path, accept: Callable[[Path], bool]) -> bool:
    """Whether one of the first DETECT_SAMPLE files of directory ``path`` is recognised by ``accept``."""
    try:
        return any(accept(candidate) for candidate in islice(_candidates(path), DETECT_SAMPLE))
    except (OSError, EvidenceError):
        return False


def register(importer: Importer) -> Importer:
    """Add ``importer`` to the registry (by name; a second registration replaces the first)."""
    _REGISTRY[importer.name] = importer
    return importer


def _import_builtin(module: str) -> None:
    try:
        import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise


def importers() -> list[Importer]:
    """Registered importers in detection order, loading the built-in modules that exist."""
    for module in _BUILTIN_MODULES:
        _import_builtin(module)
    return list(_REGISTRY.values())


def _in_detection_order() -> Iterator[Importer]:
    """The order of :func:`importers`, each built-in module imported only once the ones before it
    have been tried: a trace found by the fourth importer does not pay for the modules of the last two."""
    tried: set[str] = set()
    for module in (*_BUILTIN_MODULES, None):
        if module is not None:
            _import_builtin(module)
        for name, importer in list(_REGISTRY.items()):
            if name not in tried:
                tried.add(name)
                yield importer


def detect(path: Path) -> Importer:
    """The importer for ``path``; raises EvidenceError when none recognises it."""
    path = Path(path)
    if not path.exists():
        raise EvidenceError(f"{path}: no such file or directory")
    for importer in _in_detection_order():
        if importer.detect(path):
            return importer
    names = ", ".join(i.name for i in importers())
    raise EvidenceError(f"{path}: not a recognised evidence format (tried {names})")


def load(path: Path | str, fmt: str | None = None) -> pa.Table:
    """Load ``path`` (file or directory) into a conformed operations table.

    ``fmt`` forces an importer by name instead of detection.
    Communicators are named from the process-group tables that came with the evidence
    (``comminsight.importers.names``); the table's schema metadata says how (``naming_of``).
    """
    from comminsight.importers.names import with_names

    path = Path(path)
    if fmt is not None:
        importers()
        if fmt not in _REGISTRY:
            raise EvidenceError(f"unknown format {fmt!r} (known: {', '.join(sorted(_REGISTRY))})")
        return with_names(_REGISTRY[fmt].load(path), path)
    return with_names(detect(path).load(path), path)
