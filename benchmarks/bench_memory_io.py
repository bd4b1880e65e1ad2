"""Memory-tier parts in tmpfs: a save's write + checksum and a restore's verified read, against the raw floor.

One process, one part of ``PART_MB`` random bytes in a fresh directory under ``/dev/shm`` (the
tmpfs the tier uses), each variant timed on its own, alternately:

* write -- ``raw``: the bytes written to the file, no checksum (the floor); ``one thread``:
  :func:`elastic_ddp.memory.store.write_part` with ``threads=1``, hashing each chunk as it writes
  it (what a save does beside a CPU training step); ``beside``: ``threads=2``, a helper thread
  hashing while this one writes (what a save does on a GPU node, whose spare cores are not the
  training step's). The write time bounds how often the tier can save (``policy.interval``).
* read -- ``copy``: the file read into a new buffer, hashing each chunk as it arrives (how the tier
  read a part before it mapped them); ``mapped``: :func:`elastic_ddp.memory.store.read_part`, the
  file mapped and hashed with every core (what a restore does: it is on the critical path of
  recovery and nothing else runs). ``raw``: the file read into a buffer already touched, no
  checksum (the floor of any copy).
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import blake3
import torch

from benchmarks.common import Context, Result, Target, alternate, ratios, row
from elastic_ddp.memory.store import CHUNK, PartRecord, read_part, write_part
from elastic_ddp.memory.tier import _cores_per_rank

NAME = "memory_io"
TITLE = "Memory-tier parts in tmpfs: write + checksum and verified read vs the raw floor"
PART_MB = 512


def _median_s(fn, times: int = 3) -> float:
    """The median of ``times`` timed calls of ``fn`` (seconds)."""
    samples = []
    for _ in range(times):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def _raw_write(path: Path, view: memoryview) -> None:
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as file:
        for lo in range(0, len(view), CHUNK):
            file.write(view[lo : lo + CHUNK])
        file.truncate(len(view))


def _read_into(path: Path, target: memoryview, hasher) -> None:
    with open(path, "rb", buffering=0) as file:
        got = 0
        while got < len(target):
            n = file.readinto(target[got : got + CHUNK])
            if hasher is not None:
                hasher.update(target[got : got + n])
            got += n


def run(ctx: Context) -> Result:
    nbytes = (8 if ctx.smoke else PART_MB) << 20
    cores = max(1, int(_cores_per_rank(1)))
    directory = Path(tempfile.mkdtemp(prefix="elastic-ddp-bench-io-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        view = memoryview(data.numpy()).cast("B")
        path = directory / "part.bin"
        size, checksum = write_part(path, [view])
        record = PartRecord(1, 0, 1, size, checksum, "bench")
        touched = torch.ones(nbytes, dtype=torch.uint8)

        def copy_read() -> None:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            hasher = blake3.blake3()
            _read_into(path, memoryview(buffer.numpy()).cast("B"), hasher)
            assert hasher.hexdigest() == checksum

        def timed(fn):
            return lambda _: {"s": _median_s(fn)}

        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bench-hash") as helper:
            writes = alternate(
                {
                    "raw": timed(lambda: _raw_write(directory / "raw.bin", view)),
                    "one_thread": timed(lambda: write_part(directory / "one.bin", [view], threads=1)),
                    "beside": timed(lambda: write_part(directory / "beside.bin", [view], threads=2, helper=helper)),
                },
                ctx.repeats,
            )
        reads = alternate(
            {
                "raw": timed(lambda: _read_into(path, memoryview(touched.numpy()).cast("B"), None)),
                "copy": timed(copy_read),
                "mapped": timed(lambda: read_part(path, record, threads=cores)),
            },
            ctx.repeats,
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)

    def rate(samples: list[float]) -> list[float]:
        return [nbytes / s / 1e9 for s in samples]

    w = {name: writes[name]["s"] for name in writes}
    r = {name: reads[name]["s"] for name in reads}
    return Result(
        NAME,
        TITLE,
        params={"part_bytes": nbytes, "cores": cores, "chunk_bytes": CHUNK, "repeats": ctx.repeats},
        samples={"write": writes, "read": reads},
        rows=[
            row("write, raw (no checksum)", rate(w["raw"]), "GB/s"),
            row("write + BLAKE3, one thread (a save beside CPU training)", rate(w["one_thread"]), "GB/s"),
            row("write + BLAKE3 hashed beside it, 2 threads (a save on a GPU node)", rate(w["beside"]), "GB/s"),
            row("one thread / raw write", ratios(w["raw"], w["one_thread"]), "ratio"),
            row("hashed beside / raw write", ratios(w["raw"], w["beside"]), "ratio",
                note="1 when the hash keeps up with the write: with one hashing thread it cannot here (notes)"),  # fmt: skip
            row("hashed beside / one thread (save write speed-up)", ratios(w["one_thread"], w["beside"]), "ratio",
                Target(">=", 1.2)),  # fmt: skip
            row("read, raw (into a touched buffer, no checksum)", rate(r["raw"]), "GB/s"),
            row("verified read into a new buffer (the earlier restore)", rate(r["copy"]), "GB/s"),
            row(f"verified read of the mapped part, {cores} hashing threads (a restore)", rate(r["mapped"]), "GB/s"),
            row("mapped / new buffer (restore read speed-up)", ratios(r["copy"], r["mapped"]), "ratio", Target(">=", 1.5),
                note="a new buffer is page-faulted in as it is filled; a mapping has the pages already"),  # fmt: skip
            row("mapped / raw read", ratios(r["raw"], r["mapped"]), "ratio"),
        ],
        notes=[
            f"One part of {nbytes >> 20} MiB in /dev/shm, each variant the median of 3 calls per repeat; rates are "
            "bytes / time. A restore's mapped read also needs no second copy of the part in the process's memory "
            "(at 2 GB a rank, 16 GB a node less than a copying read).",
            "With 2 threads one of them hashes, and one core's BLAKE3 is slower than a tmpfs write here, so the "
            "hash, not the write, bounds the save. A GPU node's rank hashes with up to 3 threads beside its write "
            "(MemoryTier.write_threads: half its share of the cores, at most 4 in all), which this 2-core machine "
            "cannot show.",
        ],
    )
