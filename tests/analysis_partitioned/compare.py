"""Comparing reports of the same data: the lists whose order of ties the analyses leave open, sorted."""

from __future__ import annotations

import json


def _sorted(items: list) -> list:
    return sorted(items, key=lambda item: json.dumps(item, sort_keys=True))


def settled(report: dict) -> dict:
    """The hang report with the lists whose ties the analysis leaves in no fixed order (on the whole
    table too: groups with equal sort keys, a rank's blocked groups without times) sorted."""
    chain = [{**link, "blocks": _sorted(link["blocks"])} for link in report["chain"]]
    return {**report, "chain": chain, "stuck_groups": _sorted(report["stuck_groups"])}


def canonical(report: dict) -> dict:
    """Lists of rows sorted (polars' group-by does not fix the order of ties), floats to 12 digits."""

    def norm(value):
        if isinstance(value, float):
            return round(value, 12)
        if isinstance(value, dict):
            return {k: norm(v) for k, v in value.items()}
        if isinstance(value, list):
            return sorted((norm(v) for v in value), key=lambda v: json.dumps(v, sort_keys=True))
        return value

    return norm(report)


def step_doc(report) -> dict:
    """What a user reads of a step recovery (``StepReport``): its method, each rank's, the steps, the agreement
    with labels and each rank's steps."""
    return {
        "method": report.method,
        "methods": report.methods_by_rank,
        "steps": report.steps,
        "agreement": report.agreement,
        "rank_steps": report.rank_steps.to_dicts(),
    }
