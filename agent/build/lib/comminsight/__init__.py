"""CommInsight: diagnose hangs, stragglers and failures in distributed GPU training.

The library is shared by the node agent (live), the ``comminsight`` CLI (offline) and
the Django site's Celery workers (server). It never imports Django.
"""

__version__ = "0.1.0"
