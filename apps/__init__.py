"""Django apps of the CommInsight site: accounts, workloads (and ingest), analysis."""
