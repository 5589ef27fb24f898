"""The CommInsight node agent: consumes the profiler's rings and raw logs on one node, keeps live
progress, detects hangs, serves /healthz, /metrics and a JSON runtime API, and seals closed raw-log
segments into archives that it hands to archive providers (shared filesystem, the site).

Entry point: ``comminsight agent run`` (``comminsight.agent.daemon.run``). Operation: docs/agent.md.
"""

AGENT_VERSION = "0.1.0"
