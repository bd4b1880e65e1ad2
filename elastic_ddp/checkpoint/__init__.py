"""Sharded, atomic, verified checkpoints over fsspec, in a tensor-only format.

See docs/checkpoints.md for the layout, the commit protocol and the measured costs.
"""

from elastic_ddp.checkpoint.errors import CheckpointError, CheckpointVerificationError
from elastic_ddp.checkpoint.fence import FENCE_NAME, StaleWriterError
from elastic_ddp.checkpoint.index import INDEX_NAME
from elastic_ddp.checkpoint.catalog import CheckpointInfo, list_checkpoints, read_checkpoint, retention_plan, verify_checkpoint
from elastic_ddp.checkpoint.manager import CheckpointManager, LoadStats, SaveStats
from elastic_ddp.checkpoint.manifest import ENV_CHECKPOINT_KEY, MANIFEST_NAME, ManifestError, VerifyResult
from elastic_ddp.checkpoint.storage import Storage, StorageError

__all__ = [
    "ENV_CHECKPOINT_KEY",
    "FENCE_NAME",
    "INDEX_NAME",
    "MANIFEST_NAME",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointVerificationError",
    "LoadStats",
    "ManifestError",
    "SaveStats",
    "StaleWriterError",
    "Storage",
    "StorageError",
    "VerifyResult",
    "list_checkpoints",
    "read_checkpoint",
    "retention_plan",
    "verify_checkpoint",
]
