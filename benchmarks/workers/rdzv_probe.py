"""Trivial torchrun worker: prints the wall-clock time right after the process group formed."""

import time

import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    print(f"RDZV_PROBE ready_wall={time.time():.6f} rank={dist.get_rank()} world_size={dist.get_world_size()}", flush=True)
    # No rank leaves before every rank's group is up: gloo's connection of a slower rank fails
    # ("Connection closed by peer") when a peer that finished first has already gone.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
