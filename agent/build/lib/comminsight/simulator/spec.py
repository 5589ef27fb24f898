"""What the parent hands each rank process: its spec file and its launcher environment.

Kept apart from ``rank`` so the parent (and ``import comminsight.simulator``) never imports the
module that ``python -m comminsight.simulator.rank`` runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from comminsight.simulator.plan import SimulationConfig, config_from_dict, config_to_dict

EXIT_ABORTED = 3  # a rank that stopped waiting and finalized because the run was ended
EXIT_FAILED = 4  # a rank that raised


@dataclass(frozen=True)
class RankSpec:
    """What the parent hands a rank process (as a JSON file named on its command line)."""

    config: SimulationConfig
    rank: int
    plugin: str
    home: str
    board: str
    journal: str

    def to_json(self) -> str:
        """The spec as JSON."""
        data = {k: getattr(self, k) for k in ("rank", "plugin", "home", "board", "journal")}
        return json.dumps({**data, "config": config_to_dict(self.config)})

    @classmethod
    def from_json(cls, text: str) -> RankSpec:
        """Parse ``to_json``'s output."""
        data = json.loads(text)
        if not isinstance(data, dict) or set(data) != {"rank", "plugin", "home", "board", "journal", "config"}:
            raise ValueError("a rank spec is an object with rank, plugin, home, board, journal and config")
        spec = cls(config=config_from_dict(data.pop("config")), **data)
        if not isinstance(spec.rank, int) or not 0 <= spec.rank < spec.config.ranks:
            raise ValueError(f"rank {spec.rank!r} is not in the job")
        return spec


def rank_environment(config: SimulationConfig, rank: int, home: str) -> dict[str, str]:
    """The launcher environment of ``rank``: torchrun's variables, the node's address, the home."""
    per_node = config.ranks_per_node
    node = rank // per_node
    node_ip = f"10.0.{node // 250}.{node % 250 + 1}"
    return {
        "COMMINSIGHT_HOME": home,
        "RANK": str(rank),
        "WORLD_SIZE": str(config.ranks),
        "LOCAL_RANK": str(rank % per_node),
        "LOCAL_WORLD_SIZE": str(per_node),
        "GROUP_RANK": str(node),
        "NODE_RANK": str(node),
        "NODE_IP": node_ip,
        "HOST_IP": node_ip,
    }
