"""What an uninterrupted run consumes: the reference a test's ledger history is compared with."""

from __future__ import annotations

from elastic_ddp.data import DataCursor, ElasticSampler


def data_order(
    num_samples: int, global_batch_size: int, seed: int, num_steps: int, start: DataCursor = DataCursor()
) -> list[list[int]]:
    """The global batch of each of ``num_steps`` steps from ``start`` (default: the first steps), from the
    data order itself."""
    sampler, cursor, batches = ElasticSampler(num_samples, global_batch_size, seed), start, []
    for _ in range(num_steps):
        indices, cursor = sampler.batch_at(cursor)
        batches.append(indices)
    return batches
