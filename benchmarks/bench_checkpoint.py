"""Checkpoint save: CheckpointManager (sync, async) vs torch.save, plain dcp.save and the floors.

One process, no process group (the manager then works as a world of one), the same state for
every method, on the same disk (run.py's --work-dir, default: the temp dir) and then on a loopback S3 server
(moto_server, through s3fs). Floors: ``raw`` writes the same tensor bytes sequentially into one
file (fsync'd); ``memcpy`` copies them into preallocated host buffers. Local writes are fsync'd by
every method (the manager and DCP do it themselves; torch.save and raw get an explicit fsync).
The async stall is the time ``save()`` blocks the training step; ``async total`` runs to the commit.
The two managers live across repeats (as in training), each save a new step.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from benchmarks.common import Context, Result, Target, alternate, ratios, row
from benchmarks.state import TrainState, build_state, memcpy, raw_write, timed, torch_save

NAME = "checkpoint"
TITLE = "Checkpoint save: manager sync/async vs torch.save, dcp.save, disk and memcpy floors"

GB = 1e9


def manager(url: str, async_save: bool, storage_options: dict | None = None):
    from elastic_ddp.checkpoint import CheckpointManager
    from elastic_ddp.config import CheckpointConfig

    cfg = CheckpointConfig(url=url, async_save=async_save, keep_last=100, storage_options=storage_options or {})
    return CheckpointManager(cfg, identity={"benchmark": NAME})


class Managers:
    """A sync and an async CheckpointManager that live across repeats, as in a training run.

    The async one saves once untimed first: its host staging buffers are allocated by the first
    save and reused by every later one, so a training run pays the allocation once.
    """

    def __init__(self, state: TrainState, url: Callable[[str], str], storage_options: dict | None = None) -> None:
        self.state = state
        self.sync = manager(url("mgr_sync"), False, storage_options)
        self.async_ = manager(url("mgr_async"), True, storage_options)
        self._step = 0
        self.async_.save(self._next(), state.objects(), blocking=False)
        self.async_.wait()

    def _next(self) -> int:
        self._step += 1
        return self._step

    def sync_s(self) -> float:
        return timed(self.sync.save, self._next(), self.state.objects(), blocking=True)

    def async_s(self) -> dict[str, float]:
        """How long save() blocked (the training step's stall), and how long until the commit."""
        start = time.perf_counter()
        self.async_.save(self._next(), self.state.objects(), blocking=False)
        stall = time.perf_counter() - start
        self.async_.wait()
        return {"stall_s": stall, "total_s": time.perf_counter() - start}

    def close(self) -> None:
        self.sync.close()
        self.async_.close()


def dcp_save(state: TrainState, path: str) -> None:
    model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def _local_variants(state: TrainState, root: Path, managers: Managers):
    tensors = state.tensors()
    buffers = [torch.empty_like(t) for t in tensors]
    memcpy(tensors, buffers)  # first touch of the buffers' pages is not part of the floor

    def fresh(name: str) -> str:
        path = root / name
        shutil.rmtree(path, ignore_errors=True)
        if path.exists():
            path.unlink()
        return str(path)

    return {
        "memcpy": lambda i: {"s": timed(memcpy, tensors, buffers)},
        "raw": lambda i: {"s": timed(raw_write, tensors, fresh("raw.bin"))},
        "torch_save": lambda i: {"s": timed(torch_save, state, fresh("torch.pt"))},
        "dcp_save": lambda i: {"s": timed(dcp_save, state, fresh("dcp"))},
        "mgr_sync": lambda i: {"s": managers.sync_s()},
        "mgr_async": lambda i: managers.async_s(),
    }


def _s3_variants(state: TrainState, url: Callable[[str], str], options: dict, managers: Managers):
    tensors = state.tensors()
    return {
        "raw": lambda i: {"s": timed(raw_write, tensors, url("raw.bin"), options)},
        "torch_save": lambda i: {"s": timed(torch_save, state, url("torch.pt"), options)},
        "mgr_sync": lambda i: {"s": managers.sync_s()},
        "mgr_async": lambda i: managers.async_s(),
    }


def _rows(samples, nbytes: int, where: str, with_floors: bool) -> list[dict]:
    def s(name: str, metric: str = "s") -> list[float]:
        return samples[name][metric]

    gbps = lambda name, metric="s": [nbytes / GB / t for t in s(name, metric)]  # noqa: E731
    rows = []
    labels = {
        "memcpy": "memcpy (staging floor)", "raw": "raw sequential write (floor)",
        "torch_save": "torch.save (rank 0)", "dcp_save": "plain dcp.save",
        "mgr_sync": "manager, sync save",
    }  # fmt: skip
    for name, label in labels.items():
        if name in samples:
            rows.append(row(f"{where}: {label}", gbps(name), "GB/s"))
    rows.append(row(f"{where}: manager, async stall", s("mgr_async", "stall_s"), "s"))
    rows.append(row(f"{where}: manager, async to commit", gbps("mgr_async", "total_s"), "GB/s"))
    if with_floors:
        rows.append(row(f"{where}: async stall / memcpy", ratios(s("mgr_async", "stall_s"), s("memcpy")), "ratio",
                        Target("<=", 2.0)))
    rows.append(row(f"{where}: async stall / sync save", ratios(s("mgr_async", "stall_s"), s("mgr_sync")), "ratio",
                    Target("<=", 0.10)))
    rows.append(row(f"{where}: sync save speed / raw floor", ratios(s("raw"), s("mgr_sync")), "ratio",
                    Target(">=", 0.8)))
    rows.append(row(f"{where}: sync save speed / torch.save", ratios(s("torch_save"), s("mgr_sync")), "ratio",
                    Target(">=", 1.0, "> 1 (faster)")))
    return rows


def run(ctx: Context) -> Result:
    from tests.fixtures.s3 import _ENV, BUCKET, MotoServer, _free_port

    local_mb, s3_mb = (4, 2) if ctx.smoke else (512, 96)
    result = Result(NAME, TITLE)

    state = build_state(local_mb)
    local_bytes = state.nbytes
    root = ctx.scratch(f"{NAME}/local")
    managers = Managers(state, lambda name: str(root / name))
    try:
        local = alternate(_local_variants(state, root, managers), ctx.repeats)
    finally:
        managers.close()
    del state, managers

    server = MotoServer(_free_port())
    saved = {k: os.environ.get(k) for k in [*_ENV, "AWS_ENDPOINT_URL"]}
    os.environ.update(_ENV)
    os.environ["AWS_ENDPOINT_URL"] = server.moto_endpoint  # straight to moto, not through the test relay
    server.launch()
    try:
        state = build_state(s3_mb)
        s3_bytes = state.nbytes
        prefix = f"s3://{BUCKET}/bench-{uuid.uuid4().hex[:8]}"

        def url(name: str) -> str:
            return f"{prefix}/{name}-{uuid.uuid4().hex[:8]}"

        managers = Managers(state, url)
        try:
            remote = alternate(_s3_variants(state, url, {}, managers), ctx.repeats)
        finally:
            managers.close()
    finally:
        server.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    result.params = {"local_state_bytes": local_bytes, "s3_state_bytes": s3_bytes, "repeats": ctx.repeats,
                     "local_dir": str(ctx.work_dir), "s3": "moto_server on loopback via s3fs"}
    result.samples = {"local": local, "s3": remote}
    result.rows = _rows(local, local_bytes, "disk", True) + _rows(remote, s3_bytes, "S3", False)
    result.notes.append(
        "One process, no process group; the page cache is not dropped between runs (shared machine), "
        "so every method writes into the same warm cache and pays its own fsync."
    )
    return result
