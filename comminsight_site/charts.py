"""Every picture of the site as an ECharts option, built here on the server from what pages already have.

A template declares ``<div data-chart="ID">`` plus ``{{ option|json_script:"ID" }}``; ``frontend/src/charts.ts``
draws it. Functions here take plain data (analysis results, communicator lists) and return JSON-ready dicts;
they never read the database. Options are bounded: a picture shows at most a few thousand marks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from itertools import pairwise
from typing import Any

MAX_POINTS = 5000
DIMENSION_COLOURS = {"tp": "#d92d20", "pp": "#3451d1", "dp": "#079455", "cp": "#b54708", "ep": "#6941c6"}
NODE_COLOURS = ["#3451d1", "#079455", "#b54708", "#6941c6", "#0e7090", "#c11574", "#475467", "#d92d20"]


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def size_label(nbytes: float) -> str:
    """Message sizes the way people say them: 4 KiB, 1 MiB."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _tooltip() -> dict[str, Any]:
    return {"trigger": "item", "confine": True}


# --- topology -------------------------------------------------------------------------------------------------


def topology_option(
    *,
    rank_nodes: Mapping[int, str],
    communicators: Iterable[Mapping[str, Any]],
    coordinates: Mapping[int, Mapping[str, tuple[int, int]]],
    lagging: Iterable[int] = (),
) -> dict[str, Any]:
    """Ranks as dots coloured by their machine; an edge joins ranks that share a TP/PP/DP group.

    With Megatron coordinates the ranks sit in a grid (a row per pipeline stage, data-parallel replicas side
    by side, tensor-parallel ranks adjacent); without them, on a circle. Lagging ranks are drawn hollow red.
    """
    ranks = sorted(rank_nodes)[:MAX_POINTS]
    machines = sorted(set(rank_nodes.values()))
    lagging_set = set(lagging)
    gridded = bool(ranks) and all("pp" in coordinates.get(r, {}) or "dp" in coordinates.get(r, {}) for r in ranks)
    tp_size = 1 + max((coordinates.get(r, {}).get("tp", (0, 0))[1] for r in ranks), default=0)
    nodes = []
    for rank in ranks:
        coords = coordinates.get(rank, {})
        label = ", ".join(f"{dim.upper()} {idx}" for dim, (_, idx) in sorted(coords.items()) if dim != "mp")
        node: dict[str, Any] = {
            "id": str(rank),
            "name": f"rank {rank}",
            "value": f"{rank_nodes[rank]}" + (f" · {label}" if label else ""),
            "category": machines.index(rank_nodes[rank]),
            "symbolSize": 26,
            "label": {"show": True, "formatter": str(rank)},
        }
        if gridded:
            stage = coords.get("pp", (0, 0))[1]
            replica = coords.get("dp", (0, 0))[1]
            column = coords.get("tp", (0, 0))[1]
            node["x"] = replica * (tp_size + 0.8) * 70 + column * 70
            node["y"] = stage * 90
        if rank in lagging_set:
            node["itemStyle"] = {"color": "#fff", "borderColor": "#d92d20", "borderWidth": 3}
        nodes.append(node)
    known = {str(r) for r in ranks}
    edges = []
    for communicator in communicators:
        name = str(communicator.get("comm_name") or "")
        dimension = name.rstrip("0123456789").rstrip("-_").lower()
        members = sorted(int(r) for r in communicator.get("ranks") or [])
        if dimension not in DIMENSION_COLOURS or len(members) < 2:
            continue
        for a, b in pairwise(members):
            if str(a) in known and str(b) in known:
                edges.append(
                    {
                        "source": str(a),
                        "target": str(b),
                        "value": f"{name} ({dimension.upper()})",
                        "lineStyle": {
                            "color": DIMENSION_COLOURS[dimension],
                            "width": 2,
                            "opacity": 0.7,
                            "curveness": 0.15 if dimension == "dp" else 0,
                        },
                    }
                )
    return {
        "tooltip": {**_tooltip(), "formatter": "{b}: {c}"},
        "legend": {"data": machines, "top": 0},
        "color": NODE_COLOURS,
        "series": [
            {
                "type": "graph",
                "layout": "none" if gridded else "circular",
                "roam": True,
                "top": 40,
                "categories": [{"name": m} for m in machines],
                "data": nodes,
                "links": edges[: MAX_POINTS * 2],
                "emphasis": {"focus": "adjacency"},
            }
        ],
    }


# --- hang -----------------------------------------------------------------------------------------------------


def _operation(group: Mapping[str, Any]) -> str:
    return f"{group.get('group_desc') or group.get('group_id', '')} {group.get('op', '')} seq {group.get('seq', '')}"


def hang_chain_option(result: Mapping[str, Any]) -> dict[str, Any] | None:
    """Who waits on whom: an arrow from each waiting rank to the rank it waits on; the root cause in red,
    labelled with the first operation it never completed."""
    chain = [entry for entry in result.get("chain") or [] if isinstance(entry, Mapping)][:MAX_POINTS]
    if not chain:
        return None
    roots = set(result.get("root_cause_ranks") or [])
    stuck = (result.get("stuck_groups") or [{}])[0]
    first_op = (
        f"{stuck.get('group_desc') or stuck.get('group_id', '')} {stuck.get('op', '')} seq {stuck.get('seq', '')}"
    )
    depth_rows: dict[int, int] = {}
    nodes, links = [], []
    for entry in chain:
        rank, depth = int(entry["rank"]), int(entry.get("depth") or 0)
        row = depth_rows.get(depth, 0)
        depth_rows[depth] = row + 1
        blocks = entry.get("blocks") or []
        waits_in = "; ".join(
            f"{b.get('group_desc') or b.get('group_id')} {b.get('op')} seq {b.get('seq')}" for b in blocks[:3]
        )
        is_root = rank in roots
        nodes.append(
            {
                "id": str(rank),
                "name": f"rank {rank}",
                "x": depth * 160,
                "y": row * 60,
                "symbolSize": 44 if is_root else 30,
                "value": (f"stopped first; never completed {first_op}" if is_root else f"waits in {waits_in}"),
                "itemStyle": {"color": "#d92d20" if is_root else "#98a2b3"},
                "label": {"show": True, "formatter": str(rank), "color": "#fff" if is_root else "#1c2330"},
            }
        )
        if entry.get("waits_on") is not None:
            links.append({"source": str(rank), "target": str(entry["waits_on"]), "value": "waits on"})
    return {
        "tooltip": {**_tooltip(), "formatter": "{b}: {c}"},
        "series": [
            {
                "type": "graph",
                "layout": "none",
                "roam": True,
                "data": nodes,
                "links": links,
                "edgeSymbol": ["none", "arrow"],
                "edgeSymbolSize": 10,
                "lineStyle": {"color": "#667085", "width": 1.5},
                "emphasis": {"focus": "adjacency"},
            }
        ],
    }


# --- steps and stragglers -------------------------------------------------------------------------------------


def step_times_option(steps: Iterable[Mapping[str, Any]], offset: int = 0) -> dict[str, Any] | None:
    """Step duration per step (ms), with the slowest rank of each step in the tooltip."""
    xs, ys = [], []
    for step in list(steps)[:MAX_POINTS]:
        duration = _finite(step.get("duration_ms"))
        if duration is None:
            continue
        xs.append(int(step.get("step", len(xs))) + offset)
        ys.append(round(duration, 2))
    if not xs:
        return None
    return {
        "tooltip": {"trigger": "axis"},
        "grid": {"left": 60, "right": 20, "top": 20, "bottom": 40},
        "xAxis": {"type": "category", "data": xs, "name": "step", "nameLocation": "middle", "nameGap": 28},
        "yAxis": {"type": "value", "name": "ms"},
        "series": [{"type": "bar", "data": ys, "itemStyle": {"color": "#3451d1"}}],
    }


def straggler_attribution_option(result: Mapping[str, Any]) -> dict[str, Any] | None:
    """Per rank: its straggler index (how much of the step time it costs); culprits in red."""
    ranks = [r for r in result.get("ranks") or [] if isinstance(r, Mapping)][:MAX_POINTS]
    if not ranks:
        return None
    culprits = set(result.get("culprits") or [])
    ranks = sorted(ranks, key=lambda r: int(r.get("rank", 0)))
    return {
        "tooltip": {"trigger": "axis"},
        "grid": {"left": 60, "right": 20, "top": 20, "bottom": 40},
        "xAxis": {
            "type": "category",
            "data": [int(r["rank"]) for r in ranks],
            "name": "rank",
            "nameLocation": "middle",
            "nameGap": 28,
        },
        "yAxis": {"type": "value", "name": "straggler index"},
        "series": [
            {
                "type": "bar",
                "data": [
                    {
                        "value": round(_finite(r.get("straggler_index")) or 0.0, 4),
                        "itemStyle": {"color": "#d92d20" if int(r["rank"]) in culprits else "#98a2b3"},
                    }
                    for r in ranks
                ],
            }
        ],
    }


# --- communication performance ---------------------------------------------------------------------------------


def bandwidth_option(result: Mapping[str, Any], comm_names: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """Bus bandwidth against message size, one line per (communicator, op), log-scaled sizes."""
    comm_names = comm_names or {}
    series: dict[str, list[list[float]]] = {}
    for row in (result.get("bandwidth") or [])[:MAX_POINTS]:
        busbw, size = _finite(row.get("busbw_gbs")), _finite(row.get("bytes"))
        if busbw is None or size is None or size <= 0:
            continue
        comm = str(row.get("comm_id", ""))
        name = f"{comm_names.get(comm) or comm[-6:]} {row.get('op', '')}"
        series.setdefault(name, []).append([size, round(busbw, 3)])
    if not series:
        return None
    return {
        "tooltip": {"trigger": "item", "confine": True},
        "legend": {"type": "scroll", "top": 0},
        "grid": {"left": 60, "right": 20, "top": 40, "bottom": 50},
        "xAxis": {"type": "log", "logBase": 2, "name": "message size (bytes)", "nameLocation": "middle", "nameGap": 30},
        "yAxis": {"type": "value", "name": "bus bandwidth (GB/s)"},
        "series": [
            {"type": "line", "name": name, "symbolSize": 6, "data": sorted(points)}
            for name, points in sorted(series.items())[:40]
        ],
    }


# --- about ------------------------------------------------------------------------------------------------------


def architecture_option() -> dict[str, Any]:
    """How the parts connect: the training job's profiler, the node agent, this site, its workers, the browser."""
    boxes = [
        ("Training process\n(NCCL + profiler plugin)", 0, 0, "#475467"),
        ("Node agent\n(live hang check, archives)", 300, 0, "#3451d1"),
        ("Shared archive path", 300, 180, "#98a2b3"),
        ("Site (Django, Daphne)\ningest, pages, API", 600, 0, "#079455"),
        ("Celery workers\nanalyses", 600, 180, "#b54708"),
        ("PostgreSQL · Redis ·\nParquet store", 900, 90, "#6941c6"),
        ("Browser\n(live over WebSockets)", 900, -90, "#0e7090"),
    ]
    links = [
        (0, 1, "ring,\nraw logs"),
        (1, 3, "uploads,\nheartbeats"),
        (1, 2, "sealed archives"),
        (2, 3, "discovery"),
        (3, 4, "jobs"),
        (3, 5, ""),
        (4, 5, ""),
        (3, 6, "pages, live status"),
    ]
    return {
        "series": [
            {
                "type": "graph",
                "layout": "none",
                "symbol": "roundRect",
                # Boxes narrow enough that the labels between them stay readable in a page-wide card.
                "symbolSize": [140, 48],
                "left": 80,
                "right": 80,
                "top": 40,
                "bottom": 40,
                "label": {"show": True, "color": "#fff", "fontSize": 11, "lineHeight": 15},
                "edgeSymbol": ["none", "arrow"],
                "edgeSymbolSize": 9,
                "edgeLabel": {
                    "show": True,
                    "formatter": "{c}",
                    "fontSize": 11,
                    "lineHeight": 14,
                    "color": "#475467",
                    "backgroundColor": "#fff",
                    "padding": [1, 3],
                },
                "lineStyle": {"color": "#98a2b3", "width": 1.5},
                "data": [
                    {"name": name, "x": x, "y": y, "itemStyle": {"color": colour}} for name, x, y, colour in boxes
                ],
                "links": [{"source": boxes[a][0], "target": boxes[b][0], "value": text} for a, b, text in links],
            }
        ]
    }
