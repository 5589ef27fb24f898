"""An ordinary TP x DP x PP training loop, started by torchrun, with no CommInsight code in it.

Used to prove ``comminsight inject install``: the hook reaches this script through the environment's
``.pth`` file alone. It builds Megatron-style groups with their usual descriptions (tensor, data and
pipeline parallel), then per step: an all-reduce in the TP group, activations sent from each stage to
the next (P2P in the PP group), and a gradient all-reduce in the DP group.

    torchrun --nproc-per-node 8 scripts/inject_job.py --tp 2 --pp 2 --backend nccl --steps 20
    torchrun --nproc-per-node 4 scripts/inject_job.py --tp 2 --pp 2 --backend gloo --steps 3

``--hang-rank R --hang-step S`` makes rank R skip its DP all-reduce at step S (a hang, with ground
truth); ``--gpu-lab`` applies shared/docs/GPU_LAB.md's per-rank settings (all ranks on cuda:0, each its
own NCCL host, sockets on loopback) before the process group starts.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hang-rank", type=int, default=-1)
    parser.add_argument("--hang-step", type=int, default=-1)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--gpu-lab", action="store_true")
    args = parser.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.gpu_lab:
        os.environ["NCCL_HOSTID"] = f"labhost{rank}"
        for key, value in {
            "NCCL_NET": "Socket",
            "NCCL_SOCKET_IFNAME": "lo",
            "NCCL_P2P_DISABLE": "1",
            "NCCL_SHM_DISABLE": "1",
            "NCCL_NVLS_ENABLE": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1",
        }.items():
            os.environ[key] = value

    import torch
    import torch.distributed as dist

    device = torch.device("cuda:0") if args.backend == "nccl" else torch.device("cpu")
    kwargs = {"device_id": device} if args.backend == "nccl" else {}
    dist.init_process_group(
        args.backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=args.timeout_s), **kwargs
    )
    tp, pp = args.tp, args.pp
    dp = world // (tp * pp)
    # rank = pp_index * (dp * tp) + dp_index * tp + tp_index (Megatron's default order)
    mine = {}
    for p in range(pp):
        for d in range(dp):
            ranks = [p * dp * tp + d * tp + t for t in range(tp)]
            group = dist.new_group(ranks, group_desc="TENSOR_MODEL_PARALLEL_GROUP")
            if rank in ranks:
                mine["tp"] = group
    for p in range(pp):
        for t in range(tp):
            ranks = [p * dp * tp + d * tp + t for d in range(dp)]
            group = dist.new_group(ranks, group_desc="DATA_PARALLEL_GROUP")
            if rank in ranks:
                mine["dp"] = group
    for d in range(dp):
        for t in range(tp):
            ranks = [p * dp * tp + d * tp + t for p in range(pp)]
            group = dist.new_group(ranks, group_desc="PIPELINE_MODEL_PARALLEL_GROUP")
            if rank in ranks:
                mine["pp"] = group
    stage = rank // (dp * tp)
    activations = torch.ones(1024, device=device)
    grads = torch.ones(4096, device=device)
    for step in range(args.steps):
        dist.all_reduce(activations, group=mine["tp"])
        if stage > 0:
            dist.recv(activations, src=rank - dp * tp, group=mine["pp"])
        if stage < pp - 1:
            dist.send(activations, dst=rank + dp * tp, group=mine["pp"])
        if rank == args.hang_rank and step == args.hang_step:
            print(f"rank {rank}: skipping the DP all-reduce of step {step} (injected hang)", flush=True)
        else:
            dist.all_reduce(grads, group=mine["dp"])
        activations.fill_(1.0)
        grads.fill_(1.0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if rank == 0 and step % 5 == 0:
            print(f"step {step} done", flush=True)
    if args.hang_step >= 0:
        time.sleep(args.timeout_s)  # the others are stuck; the launcher ends the job
    dist.destroy_process_group()
    print(f"rank {rank}: TRAINING-OK", flush=True)


if __name__ == "__main__":
    main()
