"""Run by the ``.pth`` line ``comminsight inject install`` writes: install the deferred hook, silently.

Kept tiny because every Python process of the environment executes it at start-up. Set
``COMMINSIGHT_INJECT=0`` to turn it off for one process without uninstalling.
"""

import os

if os.environ.get("COMMINSIGHT_INJECT", "1").strip().lower() not in ("0", "false", "no", "off"):
    try:
        from comminsight_inject.hook import install

        install()
    except Exception:  # noqa: S110 - site start-up must never fail because of the hook
        pass
