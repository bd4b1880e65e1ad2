"""Trivial torchrun worker: gloo all_reduce of ones, prints rank and world size."""

import os

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    rank, world = dist.get_rank(), dist.get_world_size()
    print(f"RDZV_WORKER rank={rank} world_size={world} sum={int(t.item())} group_rank={os.environ.get('GROUP_RANK')}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
