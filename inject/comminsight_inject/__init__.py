"""CommInsight's PyTorch import hook, as a small standard-library-only package for the workload's environment.

``python -m comminsight_inject install`` puts a ``.pth`` file into the environment, so every later
``python``/``torchrun`` process there loads ``comminsight_inject.autoload``: a deferred import hook
that waits for ``torch.distributed`` and then names every process group's NCCL communicator (see
``comminsight_inject.hook``). Nothing is imported from torch until the training script imports it.
"""

__version__ = "0.1.0"
