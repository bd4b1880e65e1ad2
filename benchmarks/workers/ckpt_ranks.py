"""Checkpoint save and resume side by side at N ranks under torchrun (bench_checkpoint, bench_resume).

Every rank builds the same training state (ByteGPT + AdamW after one step, ``--mb`` MiB of tensors:
DDP's replica), on its GPU when CUDA is available (nccl) and on the CPU otherwise (gloo). Each
variant runs between two barriers and is timed on rank 0, alternating the order every repeat.
Before a save variant runs, its previous output is deleted, untimed (the managers' checkpoints
too, so their retention has nothing to delete): every method writes into the same free space.

save:   memcpy   -- each rank copies its share of the state into preallocated host buffers
                    (pinned on GPUs): the floor of the async stall
        raw_n    -- each rank writes its share's raw bytes into a file of its own (fsync'd), in parallel
        raw_1    -- rank 0 writes all the state's raw bytes into one file (fsync'd)
        torch_save -- rank 0 ``torch.save``s the state dicts (fsync'd)
        dcp_save -- plain ``dcp.save`` on every rank
        mgr_sync -- CheckpointManager.save(blocking=True); mgr_async -- blocking=False: the stall
                    (slowest rank) and the time to the commit
resume: manager  -- a new CheckpointManager, resolve("auto"), load into a fresh state
        dcp_load -- plain ``dcp.load`` of a ``dcp.save``d checkpoint into a fresh state, every rank
        Each also reports the bytes it read from storage (summed over ranks) and the checkpoint size.

``--root`` is a local directory or an ``s3://`` prefix. Rank 0 writes ``--out`` (JSON).

    torchrun --standalone --nproc-per-node=4 benchmarks/workers/ckpt_ranks.py save --mb 1024 --root /tmp/b --out /tmp/b.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run by torchrun as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import fsspec  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402

from benchmarks.common import alternate  # noqa: E402
from benchmarks.state import TrainState, build_state, fresh_like, torch_save  # noqa: E402
from elastic_ddp.checkpoint import CheckpointManager, Storage, list_checkpoints  # noqa: E402
from elastic_ddp.checkpoint.layout import plan  # noqa: E402
from elastic_ddp.checkpoint.sharded import snapshot  # noqa: E402
from elastic_ddp.checkpoint.staging import as_buffer, byte_view  # noqa: E402
from elastic_ddp.config import CheckpointConfig  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["save", "resume"])
    parser.add_argument("--mb", type=float, required=True, help="state size in MiB (model + AdamW moments)")
    parser.add_argument("--root", required=True, help="local directory or s3:// prefix to write under")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", required=True)
    return parser.parse_args()


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.cuda = torch.cuda.is_available()
        if self.cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if self.cuda else "gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timing = dist.new_group(backend="gloo")  # barriers and small results, whatever the backend
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.root = args.root.rstrip("/")
        self.remote = "://" in self.root
        self.state = build_state(args.mb, device=self.device)
        self.cfg = CheckpointConfig(url=self.path("unused"), keep_last=1)

    def path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def barrier(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        dist.barrier(group=self.timing)

    def timed(self, fn, *args, **kwargs) -> float:
        self.barrier()
        start = time.perf_counter()
        fn(*args, **kwargs)
        self.barrier()
        return time.perf_counter() - start

    def gather(self, value):
        out = [None] * self.world
        dist.all_gather_object(out, value, group=self.timing)
        return out

    def manager(self, name: str) -> CheckpointManager:
        cfg = self.cfg.model_copy(update={"url": self.path(name)})
        return CheckpointManager(cfg, identity={"benchmark": "ckpt_ranks"})

    def share(self) -> list[tuple[torch.Tensor, int, int]]:
        """This rank's share of the replicated state as the manager plans it: (tensor, start, stop)."""
        snap = snapshot({n: o.state_dict() for n, o in self.state.objects().items()})
        layout = plan(snap.specs, range(self.world), files_per_writer=self.cfg.write_threads,
                      min_file_bytes=int(self.cfg.min_file_mb * (1 << 20)))  # fmt: skip
        return [(snap.tensors[p.tensor], p.start, p.stop) for f in layout.files_of(self.rank) for p in f.pieces]

    def remove(self, name: str) -> None:
        if self.rank == 0:
            fs, path = fsspec.core.url_to_fs(self.path(name))
            if fs.exists(path):
                fs.rm(path, recursive=True)
        self.barrier()


def write_buffers(url: str, buffers) -> None:
    with fsspec.open(url, "wb") as f:
        for buffer in buffers:
            f.write(buffer)
        f.flush()
        if hasattr(f, "fileno"):
            try:
                os.fsync(f.fileno())
            except (OSError, ValueError, NotImplementedError):  # a remote file: durable at close()
                pass


def host_bytes(tensor: torch.Tensor, start: int, stop: int) -> memoryview:
    view = byte_view(tensor, start, stop)
    return as_buffer(view if view.device.type == "cpu" else view.cpu())


def run_save(b: Bench, repeats: int) -> dict:
    share = b.share()
    share_bytes = sum((stop - start) * t.element_size() for t, start, stop in share)
    buffers = [torch.empty((stop - start) * t.element_size(), dtype=torch.uint8, pin_memory=t.is_cuda)
               for t, start, stop in share]  # fmt: skip

    def memcpy() -> None:
        for buf, (t, start, stop) in zip(buffers, share):
            buf.copy_(byte_view(t, start, stop), non_blocking=t.is_cuda)
        if b.cuda:
            torch.cuda.synchronize()

    memcpy()  # first touch of the buffers' pages is not part of the floor
    sync, async_ = b.manager("mgr_sync"), b.manager("mgr_async")
    step = [0]
    async_.save(0, b.state.objects(), blocking=False)  # allocates its staging buffers once, as training would
    async_.wait()

    def raw_n() -> float:
        mine = b.path(f"raw_n-{b.rank:05d}.bin")
        fs, path = fsspec.core.url_to_fs(mine)
        if fs.exists(path):
            fs.rm(path)
        return b.timed(lambda: write_buffers(mine, [host_bytes(*s) for s in share]))

    def raw_1() -> float:
        b.remove("raw_1.bin")
        tensors = [(t, 0, t.numel()) for t in b.state.tensors()]
        return b.timed(lambda: b.rank == 0 and write_buffers(b.path("raw_1.bin"), [host_bytes(*s) for s in tensors]))

    def torch_save_() -> float:
        b.remove("torch.pt")
        return b.timed(lambda: b.rank == 0 and torch_save(b.state, b.path("torch.pt")))

    def dcp_save() -> float:
        b.remove("dcp")
        model_sd, optim_sd = get_state_dict(b.state.model, b.state.optimizer)
        return b.timed(lambda: dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=b.path("dcp")))

    def mgr_sync() -> float:
        step[0] += 1
        # Like every other method's previous output, the previous checkpoint is deleted untimed
        # (retention would otherwise delete it after this save, in the background).
        sync.remove_all()
        seconds = b.timed(sync.save, step[0], b.state.objects(), blocking=True)
        if sync.last_error:
            raise RuntimeError(sync.last_error)
        return seconds

    def mgr_async() -> dict:
        step[0] += 1
        async_.remove_all()
        b.barrier()
        start = time.perf_counter()
        async_.save(step[0], b.state.objects(), blocking=False)
        stall = time.perf_counter() - start
        async_.wait()
        b.barrier()
        total = time.perf_counter() - start
        if async_.last_error:
            raise RuntimeError(async_.last_error)
        stats = async_.last_save
        return {"stall_s": max(b.gather(stall)), "total_s": total,
                "staged_bytes": max(b.gather(stats.staged_bytes)), "written_bytes": max(b.gather(stats.written_bytes))}  # fmt: skip

    variants = {
        "memcpy": lambda i: {"s": max(b.gather(b.timed(memcpy)))},
        "raw_n": lambda i: {"s": raw_n()},
        "raw_1": lambda i: {"s": raw_1()},
        "torch_save": lambda i: {"s": torch_save_()},
        "dcp_save": lambda i: {"s": dcp_save()},
        "mgr_sync": lambda i: {"s": mgr_sync()},
        "mgr_async": lambda i: mgr_async(),
    }
    samples = alternate(variants, repeats)
    sync.close()
    async_.close()
    for name in (*(f"raw_n-{r:05d}.bin" for r in range(b.world)), "raw_1.bin", "torch.pt", "dcp", "mgr_sync", "mgr_async"):
        b.remove(name)
    return {"samples": samples, "state_bytes": b.state.nbytes, "share_bytes": share_bytes}


class CountingReader:
    """Makes a DCP reader count the bytes it reads from storage (its items' byte ranges + .metadata)."""

    def __init__(self, checkpoint_id: str) -> None:
        if "://" in checkpoint_id:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader as base
        else:
            base = dcp.FileSystemReader
        counter = self

        class Counting(base):
            def read_metadata(self, *args, **kwargs):
                metadata = super().read_metadata(*args, **kwargs)
                fs, path = fsspec.core.url_to_fs(f"{checkpoint_id}/.metadata")
                counter.bytes_read += fs.size(path)
                return metadata

            def read_data(self, plan, planner):
                counter.bytes_read += sum(self.storage_data[item.storage_index].length for item in plan.items)
                return super().read_data(plan, planner)

        self.bytes_read = 0
        self.reader = Counting(checkpoint_id)


def checkpoint_bytes(url: str) -> int:
    fs, path = fsspec.core.url_to_fs(url)
    return sum(fs.du(path, total=False).values())


def same_state(a: TrainState, b: TrainState) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors()))


def run_resume(b: Bench, repeats: int) -> dict:
    saver = b.manager("mgr")
    if not saver.save(1, b.state.objects(), blocking=True):
        raise RuntimeError(saver.last_error)
    saver.close()
    model_sd, optim_sd = get_state_dict(b.state.model, b.state.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=b.path("dcp"))
    b.barrier()
    sizes = {"manager": list_checkpoints(Storage(b.path("mgr")))[-1].bytes, "dcp_load": checkpoint_bytes(b.path("dcp"))}
    checked = {"manager": False, "dcp_load": False}

    def via_manager() -> dict:
        target = fresh_like(b.state, seed=7, device=b.device)
        b.barrier()
        start = time.perf_counter()
        mgr = b.manager("mgr")
        opened = time.perf_counter()
        info = mgr.resolve("auto")
        if info is None:
            raise RuntimeError(f"No checkpoint found under {b.path('mgr')}.")
        resolved = time.perf_counter()
        mgr.load(info, target.objects())
        loaded = time.perf_counter()
        b.barrier()
        seconds = time.perf_counter() - start
        phases = b.gather((opened - start, resolved - opened, loaded - resolved))
        read = sum(b.gather(mgr.storage.bytes_read))
        stats = b.gather(mgr.last_load)
        mgr.close()
        if not checked["manager"]:
            checked["manager"] = all(b.gather(same_state(b.state, target)))
            if not checked["manager"]:
                raise RuntimeError("The manager's resume did not restore the saved state.")
        return {"s": seconds, "read_ratio": read / sizes["manager"], "read_s": max(s.read_s for s in stats),
                "exchange_s": max(s.exchange_s for s in stats), "open_s": max(p[0] for p in phases),
                "resolve_s": max(p[1] for p in phases), "load_s": max(p[2] for p in phases)}  # fmt: skip

    def via_dcp() -> dict:
        target = fresh_like(b.state, seed=7, device=b.device)
        counting = CountingReader(b.path("dcp"))
        b.barrier()
        start = time.perf_counter()
        # Inside the timed window, as the manager's load takes the objects' state dicts itself
        # (for a fresh optimizer that includes allocating its state).
        model_sd, optim_sd = get_state_dict(target.model, target.optimizer)
        sd = {"model": model_sd, "optim": optim_sd}
        dcp.load(sd, storage_reader=counting.reader)
        set_state_dict(target.model, target.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        b.barrier()
        seconds = time.perf_counter() - start
        read = sum(b.gather(counting.bytes_read))
        if not checked["dcp_load"]:
            checked["dcp_load"] = all(b.gather(same_state(b.state, target)))
            if not checked["dcp_load"]:
                raise RuntimeError("dcp.load did not restore the saved state.")
        return {"s": seconds, "read_ratio": read / sizes["dcp_load"]}

    samples = alternate({"manager": lambda i: via_manager(), "dcp_load": lambda i: via_dcp()}, repeats)
    for name in ("mgr", "dcp"):
        b.remove(name)
    return {"samples": samples, "state_bytes": b.state.nbytes, "checkpoint_bytes": sizes}


def main() -> int:
    args = parse_args()
    b = Bench(args)
    data = run_save(b, args.repeats) if args.mode == "save" else run_resume(b, args.repeats)
    data.update({"ranks": b.world, "device": str(b.device), "backend": dist.get_backend(), "root": b.root})
    if b.rank == 0:
        Path(args.out).write_text(json.dumps(data, indent=1))
    b.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
