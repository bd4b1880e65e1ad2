"""elastic_ddp: fault-tolerant, elastic PyTorch DDP training on torchrun with an etcd v3 rendezvous.

The public API for a training script (see docs/your-model.md)::

    import elastic_ddp as edp

    def train(run: edp.Run) -> None:
        ...
        ddp_model = run.setup(model, optimizer, scheduler)
        for step in run.steps(dataset):
            for x, y in step:
                step.backward(loss_fn(ddp_model(x), y))
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

    edp.launch(train, Settings)

Imports are lazy, so that ``import elastic_ddp`` (which torchrun's agent does through the
rendezvous plugin) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "IDENTITY",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "DistConfig",
    "LoggingConfig",
    "Run",
    "RunConfig",
    "RunError",
    "SampleDropout",
    "Section",
    "ShardError",
    "Shards",
    "Step",
    "TrainConfig",
    "derive_seed",
    "launch",
    "load_config",
]

_LAZY = {
    "launch": "elastic_ddp.worker.launch",
    "Run": "elastic_ddp.worker.run",
    "RunError": "elastic_ddp.worker.run",
    "Step": "elastic_ddp.worker.step",
    "IDENTITY": "elastic_ddp.config",
    "CheckpointConfig": "elastic_ddp.config",
    "Config": "elastic_ddp.config",
    "DataConfig": "elastic_ddp.config",
    "DistConfig": "elastic_ddp.config",
    "LoggingConfig": "elastic_ddp.config",
    "RunConfig": "elastic_ddp.config",
    "Section": "elastic_ddp.config",
    "TrainConfig": "elastic_ddp.config",
    "load_config": "elastic_ddp.config",
    "SampleDropout": "elastic_ddp.worker.nn",
    "derive_seed": "elastic_ddp.data.seeds",
    "Shards": "elastic_ddp.data.shards",
    "ShardError": "elastic_ddp.data.shard_formats",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic_ddp' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)
