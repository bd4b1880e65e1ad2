"""Resume at 4 ranks: CheckpointManager (read once, verify while reading, broadcast) vs plain dcp.load on every rank.

Four ranks under torchrun (``benchmarks/workers/ckpt_ranks.py``) save the same state once with each
method (untimed), then, alternately, load it into a fresh model and optimizer of the same shape:
``manager`` = a new CheckpointManager, ``resolve("auto")`` (lists, reads the index, each rank reads
and hashes its share of the files) and ``load`` (the state goes to every rank over the process
group); ``dcp.load`` = DCP's default planner on every rank, which reads the whole replicated state
on each of them. Both count the bytes they read from storage (the manager through its storage
layer; DCP through a reader that adds up its items' byte ranges and ``.metadata``), summed over the
ranks and divided by the checkpoint's size. Local disk first, then a loopback S3 server (moto).
"""

from __future__ import annotations

from benchmarks.bench_checkpoint import on_s3, run_ranks
from benchmarks.common import Context, Result, Target, ratios, row

NAME = "resume"
TITLE = "Resume at 4 ranks: manager (each byte read once, then broadcast) vs dcp.load on every rank"


def _rows(data: dict, where: str) -> list[dict]:
    m, d = data["samples"]["manager"], data["samples"]["dcp_load"]
    return [
        row(f"{where}: manager resume (list, read + verify, broadcast, load)", m["s"], "s"),
        row(f"{where}: of which a new manager (gloo group, storage probe; slowest rank)", m["open_s"], "s"),
        row(f"{where}: of which resolve: list, read + verify (slowest rank)", m["resolve_s"], "s"),
        row(f"{where}: of which reading and verifying the files (slowest rank)", m["read_s"], "s"),
        row(f"{where}: of which load: state dicts, broadcast, load_state_dict (slowest rank)", m["load_s"], "s"),
        row(f"{where}: of which broadcast and load_state_dict (slowest rank)", m["exchange_s"], "s"),
        row(f"{where}: plain dcp.load on every rank (get_state_dict, dcp.load, set_state_dict)", d["s"], "s"),
        row(f"{where}: time, manager / dcp.load", ratios(m["s"], d["s"]), "ratio",
            note="the manager also checks the checksum of every byte it reads"),  # fmt: skip
        row(f"{where}: manager, storage bytes read / checkpoint size", m["read_ratio"], "ratio", Target("<=", 1.1)),
        row(f"{where}: dcp.load, storage bytes read / checkpoint size", d["read_ratio"], "ratio"),
    ]


def run(ctx: Context) -> Result:
    local_mb, s3_mb = (4, 2) if ctx.smoke else (1024, 256)
    timeout_s = 300 if ctx.smoke else 1800
    local = run_ranks(ctx, "resume", local_mb, str(ctx.scratch(f"{NAME}/local")), {}, timeout_s)
    remote = on_s3(lambda root, env: run_ranks(ctx, "resume", s3_mb, root, env, timeout_s))
    return Result(
        NAME,
        TITLE,
        params={"ranks": local["ranks"], "local_state_bytes": local["state_bytes"], "s3_state_bytes": remote["state_bytes"],
                "checkpoint_bytes": {"local": local["checkpoint_bytes"], "s3": remote["checkpoint_bytes"]},
                "repeats": ctx.repeats, "device": local["device"], "backend": local["backend"]},  # fmt: skip
        samples={"local": local["samples"], "s3": remote["samples"]},
        rows=_rows(local, "disk") + _rows(remote, "S3"),
        notes=[
            "The files are in the page cache for both methods (written just before): local figures compare CPU "
            "and protocol work, not disk reads. On this 2-core machine the 4 ranks' hashing and gloo broadcasts "
            "share the same cores.",
        ],
    )
