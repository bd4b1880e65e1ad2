"""A plain hand-written DDP training loop: the baseline the recipe is compared against.

What a user writes without this framework: torch's DistributedSampler and DataLoader over the same
byte windows, the same ByteGPT and AdamW, cross-entropy, gradient clipping, and (optionally) a
``torch.save`` checkpoint from rank 0 every N steps that a restarted job resumes from. It prints
progress lines in the recipe's shape (``[rank0] step=N/MAX ... world_size=W``) so both are timed
by the same parser.

    torchrun --standalone --nproc-per-node=2 benchmarks/workers/plain_ddp.py --steps=200
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))  # the LM recipe's recipes/lm/, as `lm`
from lm import ByteGPT, ByteGPTConfig, ByteWindows, CorpusConfig, load_corpus  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--max-bytes", type=int, default=8_000_000)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--ckpt-path", default="", help="torch.save checkpoint file; resumed from if present")
    parser.add_argument("--ckpt-every", type=int, default=0, help="save every N steps (0: never)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = ByteGPT(ByteGPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    step = 0
    if args.ckpt_path and os.path.exists(args.ckpt_path):
        state = torch.load(args.ckpt_path, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        step = int(state["step"])
    ddp_model = DDP(model)

    windows = ByteWindows(load_corpus(CorpusConfig(max_bytes=args.max_bytes)), args.block_size)
    sampler = DistributedSampler(windows, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(windows, batch_size=args.global_batch_size // world, sampler=sampler, drop_last=True)
    first_logged = False
    epoch = 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            logits = ddp_model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if args.ckpt_every and step % args.ckpt_every == 0 and rank == 0:
                tmp = f"{args.ckpt_path}.tmp"
                torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}, tmp)
                os.replace(tmp, args.ckpt_path)
            if rank == 0 and (step % args.log_every == 0 or not first_logged or step == args.steps):
                first_logged = True
                print(f"[rank0] step={step}/{args.steps} loss={loss.item():.4f} world_size={world}", flush=True)
            if step >= args.steps:
                break
        epoch += 1
    dist.destroy_process_group()
    # Leave here, as the recipe's launch() does, with the DDP model still referenced: torch 2.13 can
    # deadlock when it is freed (the reducer's gloo group joins its run-loop thread, which waits for
    # the GIL the freeing main thread holds; seen here, a worker hung for minutes at main()'s return).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
