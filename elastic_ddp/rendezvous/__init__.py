"""etcd v3 rendezvous for torchrun (``--rdzv-backend=etcd`` / ``etcd-v3``).

Importing this package is cheap: grpc and etcd3 load only when a backend is created, because
torch imports every ``torchrun.handlers`` entry point whenever its rendezvous package is imported.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EtcdClient", "EtcdV3RendezvousBackend", "EtcdV3Store", "create_backend"]

_LAZY = {
    "create_backend": "elastic_ddp.rendezvous.plugin",
    "EtcdV3RendezvousBackend": "elastic_ddp.rendezvous.backend",
    "EtcdV3Store": "elastic_ddp.rendezvous.store",
    "EtcdClient": "elastic_ddp.etcd",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic_ddp.rendezvous' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
