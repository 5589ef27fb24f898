"""Readers and writers of CommInsight's own on-disk formats (ring, raw log, archive)."""
