"""The dependency chain of a hang (analysis.hang): who waits on whom, where progress stopped first.

Waiting ranks point at the ranks they wait for; the root causes are the sink components of that
graph (Tarjan, iterative), and the chain reads outwards from them, breadth first.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Any

MAX_LISTED = 64  # cap on rank lists inside one evidence item, so 16k-rank reports stay readable


def _order_key(t: int | None, record_id: int | None) -> tuple[float, float]:
    return (t if t is not None else float("inf"), record_id if record_id is not None else float("inf"))


def blocked_earlier(first: dict | None, t: int | None, record_id: int | None, p2p_comm: str | None = None) -> bool:
    """Whether a rank's first pending operation ``first`` comes before its operation at (t, record_id).

    Then the rank's stream has not reached that operation: it is blocked in an earlier one. P2P
    operations on the same communicator are treated as one batch (1F1B posts a send and a receive
    together), never as blocking each other.
    """
    if first is None or (t is None and record_id is None):
        return False
    if p2p_comm is not None and first["is_p2p"] and first["comm_id"] == p2p_comm:
        return False
    return _order_key(first["t"], first["record_id"]) < _order_key(t, record_id)


def sink_components(edges: dict[int, set[int]], nodes: set[int]) -> list[set[int]]:
    """Strongly connected components of the graph on ``nodes`` with no edge leaving them (Tarjan, iterative)."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    on_stack: set[int] = set()
    stack: list[int] = []
    components: list[set[int]] = []
    counter = 0
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, set()) & nodes)))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = counter
                    counter += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(edges.get(succ, set()) & nodes))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                components.append(component)
    sinks = []
    for component in components:
        leaves = any((edges.get(n, set()) & nodes) - component for n in component)
        if not leaves:
            sinks.append(component)
    return sinks


def dependency_chain(
    roots: list[int], edges: dict[int, set[int]], blocked_by: dict[int, list[dict]]
) -> list[dict[str, Any]]:
    """From each root cause outwards (breadth first): the groups a rank blocks and who waits there.

    ``waits_on`` is the rank one step closer to the root cause through which the rank was reached
    (null for a root cause), so every entry's path to its root can be read back.
    """
    chain: list[dict[str, Any]] = []
    depth = dict.fromkeys(roots, 0)
    parent: dict[int, int | None] = dict.fromkeys(roots)
    queue = deque(roots)
    reverse: dict[int, set[int]] = defaultdict(set)
    for waiter, blockers in edges.items():
        for blocker in blockers:
            reverse[blocker].add(waiter)
    while queue and len(chain) < 256:
        rank = queue.popleft()
        blocks = [
            {
                "group_id": g["group_id"],
                "group_desc": g["group_desc"],
                "op": g["op"],
                "seq": g["seq"],
                "kind": g["kind"],
                "waiting_ranks": [w for w in g["waiting_ranks"] if w != rank][:MAX_LISTED],
            }
            for g in blocked_by.get(rank, [])
        ]
        chain.append({"rank": rank, "depth": depth[rank], "waits_on": parent[rank], "blocks": blocks})
        # Only waiters that block somebody themselves extend the chain.
        for waiter in sorted(reverse.get(rank, ())):
            if waiter not in depth and waiter in blocked_by:
                depth[waiter] = depth[rank] + 1
                parent[waiter] = rank
                queue.append(waiter)
    return chain


def wait_paths(chain: list[dict[str, Any]], limit: int = 16) -> list[list[int]]:
    """Paths from the outermost chain entries to their root cause (each rank waits on the next), longest first."""
    via = {link["rank"]: link["waits_on"] for link in chain}
    inner = {w for w in via.values() if w is not None}
    paths = []
    for link in chain:
        if link["rank"] in inner:
            continue
        path = [link["rank"]]
        while via.get(path[-1]) is not None:
            path.append(via[path[-1]])
        paths.append(path)
    paths.sort(key=lambda p: (-len(p), p))
    return paths[:limit]
