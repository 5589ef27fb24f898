"""The evidence model: one columnar (Arrow) schema for operations from every source."""

from comminsight.evidence.schema import OPS, PROGRESS_OP, SCHEMA, SCHEMA_VERSION, STATES, conform, empty_table

__all__ = ["OPS", "PROGRESS_OP", "SCHEMA", "SCHEMA_VERSION", "STATES", "conform", "empty_table"]
