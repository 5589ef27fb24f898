"""The PyTorch import hook, as the ``comminsight`` distribution exposes it.

The hook itself lives in the standard-library-only ``comminsight_inject`` package (inject/ in this
repository, its own small wheel) so a workload environment needs nothing else; the join lives in
``comminsight.evidence.process_groups``. This module keeps the names earlier releases documented:

    import comminsight.torch_hook; comminsight.torch_hook.install()
    python -m comminsight.torch_hook train.py ...

Installing it with no code change at all: ``comminsight inject install`` (docs/torch-hook.md).
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Iterable
from typing import Any

from comminsight_inject.hook import install, metadata_path, naming_level, process_group_table, record

from comminsight.evidence.process_groups import Observation, load_tables, name_communicators

__all__ = [
    "install",
    "join_process_groups",
    "load_tables",
    "main",
    "metadata_path",
    "naming_level",
    "process_group_table",
    "record",
]


def join_process_groups(communicators: Iterable[dict[str, Any]], tables: Iterable[dict[str, Any]]) -> dict[str, dict]:
    """Name communicators given as ``{"comm_id", "ranks", "first_seen_ns"?}`` from recorded tables."""
    observations = [
        Observation(
            comm_id=c["comm_id"],
            size=len(c["ranks"]),
            positions={int(r): None for r in c["ranks"]},
            first_seen_ns=int(c.get("first_seen_ns") or 0),
        )
        for c in communicators
    ]
    return name_communicators(observations, tables)


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
