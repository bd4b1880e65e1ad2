"""The data pipeline: corpus, world-size-independent sample order, per-rank step batches.

See docs/data.md for the guarantees (no sample repeated or skipped across restarts and world-size
changes) and for how a training loop uses these pieces.
"""

from elastic_ddp.data.corpus import corpus_fingerprint, glob_match, load_corpus, stdlib_root
from elastic_ddp.data.ledger import LedgerStep, StepLedger, read_ledger
from elastic_ddp.data.loader import MicroBatch, StepBatch, StepBatches, make_step_batch
from elastic_ddp.data.sampler import (
    ByteWindows,
    DataCursor,
    ElasticSampler,
    micro_batches,
    rank_loss_scale,
    rank_slice,
)
from elastic_ddp.data.seeds import derive_seed, sample_seeds

__all__ = [
    "ByteWindows",
    "DataCursor",
    "ElasticSampler",
    "LedgerStep",
    "MicroBatch",
    "StepBatch",
    "StepBatches",
    "StepLedger",
    "corpus_fingerprint",
    "derive_seed",
    "glob_match",
    "load_corpus",
    "make_step_batch",
    "micro_batches",
    "rank_loss_scale",
    "rank_slice",
    "read_ledger",
    "sample_seeds",
    "stdlib_root",
]
