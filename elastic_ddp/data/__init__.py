"""The data pipeline: world-size-independent sample order, per-rank step batches, the step ledger,
sharded sources (``Shards``).

See docs/data.md for the guarantees (no sample repeated or skipped across restarts and world-size
changes) and for what they require of a dataset.
"""

from elastic_ddp.data.ledger import LedgerStep, StepLedger, exactly_once_problems, read_ledger, read_skipped
from elastic_ddp.data.loader import (
    MicroBatch, StepBatch, StepBatches, check_dataset, check_same_dataset, dataset_fingerprint, make_step_batch,
    micro_weight, read_samples, to_device,
)  # fmt: skip
from elastic_ddp.data.sampler import ORDER_VERSION, DataCursor, ElasticSampler, micro_batches, rank_bounds, rank_slice
from elastic_ddp.data.seeds import derive_seed, sample_seeds
from elastic_ddp.data.shard_formats import ShardError
from elastic_ddp.data.shard_order import ShardOrder
from elastic_ddp.data.shard_units import UnitOrder
from elastic_ddp.data.shards import Shards

__all__ = [
    "ORDER_VERSION",
    "DataCursor",
    "ElasticSampler",
    "LedgerStep",
    "MicroBatch",
    "StepBatch",
    "StepBatches",
    "ShardError",
    "ShardOrder",
    "Shards",
    "StepLedger",
    "check_dataset",
    "check_same_dataset",
    "dataset_fingerprint",
    "derive_seed",
    "exactly_once_problems",
    "make_step_batch",
    "micro_batches",
    "micro_weight",
    "rank_bounds",
    "rank_slice",
    "read_ledger",
    "read_skipped",
    "read_samples",
    "sample_seeds",
    "to_device",
    "UnitOrder",
]
