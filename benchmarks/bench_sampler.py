"""Data order memory and speed: the O(1)-memory ElasticSampler vs torch's DistributedSampler.

Each variant runs in a fresh Python process that imports torch, notes its resident memory, then
produces the indices of ``STEPS`` global batches at 100M samples, and reports how far its peak
resident memory (``ru_maxrss``) rose above the noted baseline -- measured, not estimated -- and the
time per global batch. The peer is what a DDP script uses without this package: torch's
``DistributedSampler``, which builds each epoch as ``torch.randperm(n).tolist()`` in every rank and
every loader worker.
"""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks.common import REPO, Context, Result, Target, alternate, child_env, ratios, row

NAME = "sampler"
TITLE = "Data order at 100M samples: ElasticSampler vs DistributedSampler, memory per process"

GIB = 1 << 30

_CHILD = r"""
import json, resource, sys, time
import torch
variant, samples, batch, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])

def rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

if variant == "elastic":
    from elastic_ddp.data import DataCursor, ElasticSampler
    base = rss_bytes()
    start = time.perf_counter()
    sampler, cursor = ElasticSampler(samples, batch, seed=1), DataCursor()
    for _ in range(steps):
        indices, cursor = sampler.batch_at(cursor)
    elapsed = time.perf_counter() - start
else:
    from torch.utils.data import DistributedSampler
    base = rss_bytes()
    start = time.perf_counter()
    sampler = DistributedSampler(range(samples), num_replicas=1, rank=0, shuffle=True, seed=1)
    iterator = iter(sampler)  # builds the whole epoch's order, as every rank and loader worker does
    for _ in range(steps):
        indices = [next(iterator) for _ in range(batch)]
    elapsed = time.perf_counter() - start
print(json.dumps({"growth_bytes": rss_bytes() - base, "seconds_per_batch": elapsed / steps}))
"""


def _measure(variant: str, samples: int, batch: int, steps: int) -> dict[str, float]:
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, variant, str(samples), str(batch), str(steps)],
        env=child_env(), cwd=REPO, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"The {variant} sampler child failed: {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def run(ctx: Context) -> Result:
    # Smoke: large enough that the peer's lists move the peak RSS (at 1M they may fit in freed pages).
    samples = 5_000_000 if ctx.smoke else 100_000_000
    batch, steps = 1024, 20 if ctx.smoke else 100
    measured = alternate(
        {name: (lambda i, name=name: _measure(name, samples, batch, steps)) for name in ("elastic", "distributed")},
        ctx.repeats,
    )
    elastic, peer = measured["elastic"], measured["distributed"]
    growth = [b / GIB for b in elastic["growth_bytes"]]
    peer_growth = [b / GIB for b in peer["growth_bytes"]]
    return Result(
        NAME,
        TITLE,
        params={"samples": samples, "global_batch_size": batch, "batches": steps, "repeats": ctx.repeats},
        samples=measured,
        rows=[
            row("ElasticSampler: peak memory growth per process", growth, "GiB",
                Target("<=", 0.5, "≤ 0.5 GiB at 100M samples")),
            row("DistributedSampler: peak memory growth per process", peer_growth, "GiB"),
            row("ElasticSampler / DistributedSampler memory", ratios(growth, peer_growth), "ratio"),
            row("ElasticSampler: time per global batch", [s * 1e3 for s in elastic["seconds_per_batch"]], "ms"),
            row("DistributedSampler: time per global batch (epoch build amortised over the batches)",
                [s * 1e3 for s in peer["seconds_per_batch"]], "ms"),
        ],  # fmt: skip
        notes=[
            "Each rank computes only its own share of a step (1/W of the global batch); the figures above "
            "are for whole global batches, i.e. an upper bound per rank.",
            "A DataLoader worker holds its own copy of a sampler's order: the peer's growth is paid once per "
            "rank and once more per loader worker; ElasticSampler's is not.",
        ],
    )
