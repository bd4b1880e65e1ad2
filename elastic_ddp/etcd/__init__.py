"""The etcd v3 client of elastic_ddp: the only package importing ``etcd3`` and ``grpc``.

Everything above it (the rendezvous backend and handler, the c10d store, the plugin) talks to etcd
through :class:`EtcdClient` and sees only the exceptions of :mod:`elastic_ddp.etcd.errors`, so
neither ``grpc`` nor ``etcd3`` types cross the package boundary.

Modules, one concern each:

* :mod:`~elastic_ddp.etcd.ops` -- requests and results as plain values (``Range``, ``Put``, ...).
* :mod:`~elastic_ddp.etcd.errors` -- the exceptions and the one place mapping gRPC errors to them.
* :mod:`~elastic_ddp.etcd.client` -- :class:`EtcdClient`: requests, failover, auth, TLS.
* :mod:`~elastic_ddp.etcd.leases` -- :class:`LeaseKeepAlive`, renewing leases on one stream.
* :mod:`~elastic_ddp.etcd.watch` -- :class:`WatchStream`, every watch on one resumable stream.
* :mod:`~elastic_ddp.etcd.backoff` -- :class:`Backoff`, pauses between tries etcd did not answer.
* :mod:`~elastic_ddp.etcd._etcd3` -- the only module touching python-etcd3's private names.

Importing this package loads grpc and etcd3; code that must stay cheap to import (the torchrun
plugin) imports it where a client is created.
"""

from __future__ import annotations

from elastic_ddp.etcd.backoff import Backoff
from elastic_ddp.etcd.client import DEFAULT_PORT, EtcdClient, parse_endpoints
from elastic_ddp.etcd.errors import (
    EtcdAuthError, EtcdCompactedError, EtcdConnectionError, EtcdError, EtcdLeaseExistsError, EtcdLeaseNotFoundError,
)  # fmt: skip
from elastic_ddp.etcd.leases import LeaseKeepAlive
from elastic_ddp.etcd.ops import Compare, DeleteRange, KeyValue, Put, Range, RangeResult, TxnResult, prefix_end
from elastic_ddp.etcd.watch import Watch, WatchEvent, WatchStream

__all__ = [
    "DEFAULT_PORT",
    "Backoff",
    "Compare",
    "DeleteRange",
    "EtcdAuthError",
    "EtcdClient",
    "EtcdCompactedError",
    "EtcdConnectionError",
    "EtcdError",
    "EtcdLeaseExistsError",
    "EtcdLeaseNotFoundError",
    "KeyValue",
    "LeaseKeepAlive",
    "Put",
    "Range",
    "RangeResult",
    "TxnResult",
    "Watch",
    "WatchEvent",
    "WatchStream",
    "parse_endpoints",
    "prefix_end",
]
