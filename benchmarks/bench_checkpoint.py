"""Checkpoint save at 4 ranks: CheckpointManager (sync, async) vs torch.save, dcp.save and the floors.

Four ranks under torchrun (``benchmarks/workers/ckpt_ranks.py``) each hold the same ByteGPT + AdamW
state (DDP's replica; on GPUs with nccl when CUDA is available, on CPUs with gloo here) and save it,
alternating the methods every repeat, first on local disk (run.py's --work-dir, default: the temp
dir), then on a loopback S3 server (moto_server, through s3fs). Floors: ``memcpy`` copies one rank's
share into preallocated host buffers (the async stall's floor), ``raw`` writes the state's bytes
sequentially -- by 4 ranks in parallel (each its share) and by one process -- fsync'd on local disk.
``torch.save`` runs on rank 0 (fsync'd); ``dcp.save`` on every rank. The managers live across
repeats, as in training. Each method's previous output is deleted, untimed, before it runs. Rates are the state's tensor bytes over the wall time between barriers.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable

from benchmarks.common import WORKERS, Context, Result, Target, TimedProcess, child_env, ratios, row, torchrun

NAME = "checkpoint"
TITLE = "Checkpoint save at 4 ranks: manager sync/async vs torch.save, dcp.save, raw writes and memcpy"

RANKS = 4
GB = 1e9
WORKER = WORKERS / "ckpt_ranks.py"


def run_ranks(ctx: Context, mode: str, megabytes: float, root: str, env: dict[str, str], timeout_s: float) -> dict:
    """Run the worker at :data:`RANKS` ranks (2 in a smoke run, which only checks that it works); its JSON result."""
    out = ctx.work_dir / f"{mode}-{uuid.uuid4().hex[:8]}.json"
    args = [mode, "--mb", str(megabytes), "--root", root, "--repeats", str(ctx.repeats), "--out", str(out)]
    ranks = 2 if ctx.smoke else RANKS
    cmd = torchrun("--standalone", f"--nproc-per-node={ranks}", "--max-restarts=0", script=WORKER, script_args=args)
    with TimedProcess(cmd, env=child_env(**env), log_path=ctx.work_dir / f"{out.stem}.log") as proc:
        proc.check(timeout_s)
    return json.loads(out.read_text())


def on_s3(fn: Callable[[str, dict[str, str]], dict]) -> dict:
    """``fn(root, env)`` with a fresh moto S3 server: ``root`` an s3:// prefix, ``env`` the AWS settings."""
    from tests.fixtures.s3 import _ENV, BUCKET, MotoServer, _free_port

    server = MotoServer(_free_port())
    # Straight to moto, not through the test fixture's relay (which only exists to cut connections).
    env = {**_ENV, "AWS_ENDPOINT_URL": server.moto_endpoint}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)  # launch() creates the bucket from this process
    try:
        server.launch()
        return fn(f"s3://{BUCKET}/bench-{uuid.uuid4().hex[:8]}", env)
    finally:
        server.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _rows(data: dict, where: str, targets: bool) -> list[dict]:
    s = data["samples"]
    nbytes = data["state_bytes"]
    ranks = data["ranks"]

    def secs(name: str, metric: str = "s") -> list[float]:
        return s[name][metric]

    def gbps(name: str, metric: str = "s") -> list[float]:
        return [nbytes / GB / t for t in secs(name, metric)]

    def target(op: str, value: float, text: str = "") -> Target | None:
        return Target(op, value, text) if targets else None

    raw_floor = [min(a, b) for a, b in zip(secs("raw_n"), secs("raw_1"))]  # the faster way to write the bytes
    share = nbytes / ranks
    return [
        row(f"{where}: memcpy of one rank's share (stall floor)", secs("memcpy"), "s"),
        row(f"{where}: raw write, {ranks} ranks in parallel", gbps("raw_n"), "GB/s"),
        row(f"{where}: raw write, one process", gbps("raw_1"), "GB/s"),
        row(f"{where}: torch.save (rank 0)", gbps("torch_save"), "GB/s"),
        row(f"{where}: plain dcp.save ({ranks} ranks)", gbps("dcp_save"), "GB/s"),
        row(f"{where}: manager, sync save", gbps("mgr_sync"), "GB/s"),
        row(f"{where}: manager, async stall (slowest rank)", secs("mgr_async", "stall_s"), "s"),
        row(f"{where}: manager, async to commit", gbps("mgr_async", "total_s"), "GB/s"),
        row(f"{where}: staged bytes per rank / (state / ranks)", [b / share for b in secs("mgr_async", "staged_bytes")],
            "ratio", target("<=", 1.2)),  # fmt: skip
        row(f"{where}: async stall / memcpy of the share", ratios(secs("mgr_async", "stall_s"), secs("memcpy")), "ratio",
            target("<=", 2.0)),  # fmt: skip
        row(f"{where}: sync save speed / raw floor", ratios(raw_floor, secs("mgr_sync")), "ratio", target(">=", 0.8),
            note="floor: the faster of the two raw writes of each repeat"),  # fmt: skip
        row(f"{where}: sync save speed / torch.save", ratios(secs("torch_save"), secs("mgr_sync")), "ratio",
            target(">=", 1.0, "≥ 1 (as fast or faster)")),  # fmt: skip
        row(f"{where}: sync save speed / dcp.save", ratios(secs("dcp_save"), secs("mgr_sync")), "ratio"),
    ]


def run(ctx: Context) -> Result:
    local_mb, s3_mb = (4, 2) if ctx.smoke else (1024, 256)
    timeout_s = 300 if ctx.smoke else 1800
    local_root = ctx.scratch(f"{NAME}/local")
    local = run_ranks(ctx, "save", local_mb, str(local_root), {}, timeout_s)
    remote = on_s3(lambda root, env: run_ranks(ctx, "save", s3_mb, root, env, timeout_s))
    return Result(
        NAME,
        TITLE,
        params={"ranks": local["ranks"], "local_state_bytes": local["state_bytes"], "s3_state_bytes": remote["state_bytes"],
                "share_bytes": local["share_bytes"], "repeats": ctx.repeats, "device": local["device"],
                "backend": local["backend"], "local_dir": str(ctx.work_dir),
                "s3": "moto_server on loopback via s3fs"},  # fmt: skip
        samples={"local": local["samples"], "s3": remote["samples"]},
        rows=_rows(local, "disk", True) + _rows(remote, "S3", False),
        notes=[
            f"{local['ranks']} ranks on one machine share its cores and its disk; on this 2-core machine every rank's "
            "hashing and copying competes for the same CPUs, so the parallel figures are a floor for real nodes.",
            "The page cache is not dropped between runs (a shared machine): every method writes into the same "
            "warm cache and pays its own fsync, and each method's previous output (the managers' checkpoints "
            "included) is deleted, untimed, just before it runs, so none writes while an older copy of its "
            "output still holds memory. S3 is moto's in-memory server on loopback: it measures request "
            "and protocol overhead, not a real network.",
            f"Environment: OMP_NUM_THREADS=1 per rank; {os.cpu_count()} cores.",
        ],
    )

