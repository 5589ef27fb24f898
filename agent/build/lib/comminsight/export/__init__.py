"""Exports of the operations table to other tools' formats (Perfetto / Chrome trace)."""
