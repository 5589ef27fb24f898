"""Workloads and what belongs to them; sharing; the agents' ingest API; discovery."""
