"""Sharded, atomic, verified checkpoints over fsspec, on torch.distributed.checkpoint.

See docs/checkpoints.md for the layout, the commit protocol and the measured costs.
"""

from elastic_ddp.checkpoint.dcp_io import ENV_FAULT_POINT, CheckpointVerificationError
from elastic_ddp.checkpoint.fence import FENCE_NAME, StaleWriterError
from elastic_ddp.checkpoint.manager import (
    CheckpointError,
    CheckpointInfo,
    CheckpointManager,
    SaveStats,
    list_checkpoints,
    read_checkpoint,
    retention_plan,
    verify_checkpoint,
)
from elastic_ddp.checkpoint.manifest import ENV_CHECKPOINT_KEY, MANIFEST_NAME, ManifestError, VerifyResult
from elastic_ddp.checkpoint.storage import Storage, StorageError

__all__ = [
    "ENV_CHECKPOINT_KEY",
    "ENV_FAULT_POINT",
    "FENCE_NAME",
    "MANIFEST_NAME",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointVerificationError",
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
