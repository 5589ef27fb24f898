"""The simulator: a training job without GPUs that drives the real profiler plugin as NCCL would.

One OS process per rank loads the plugin ``.so`` and makes NCCL's profiler calls through its ABI
(cffi); ranks coordinate through a shared arrival board so that waiting in collectives is real.
Layouts: DDP, FSDP, Megatron-style TP x PP x DP; injectable faults: straggler (a whole rank or
one compute phase), late rank, hang, crash, slow link, pause. The run writes ``ground_truth.json``
next to the plugin's output. See docs/simulator.md.
"""

from comminsight.simulator.plan import (
    Crash,
    Hang,
    Late,
    SimulationConfig,
    SlowLink,
    Straggler,
    build_plan,
)
from comminsight.simulator.runner import SimulationResult, default_plugin_path, run_simulation

__all__ = [
    "Crash",
    "Hang",
    "Late",
    "SimulationConfig",
    "SimulationResult",
    "SlowLink",
    "Straggler",
    "build_plan",
    "default_plugin_path",
    "run_simulation",
]
