"""The requests and results of :class:`~elastic_ddp.etcd.client.EtcdClient`: keys, conditions,
transaction operations and range reads, as plain values (no ``etcd3`` or protobuf type leaves
this package)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import etcd3.utils
from etcd3 import etcdrpc

__all__ = ["Compare", "DeleteRange", "KeyValue", "Op", "Put", "Range", "RangeResult", "TxnResult", "prefix_end"]


@dataclass(frozen=True)
class KeyValue:
    """One stored key: its value and the revisions etcd uses for compare-and-set."""

    key: bytes
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int


def prefix_end(prefix: bytes | str) -> bytes:
    """The first key after every key starting with ``prefix`` (a range's exclusive end)."""
    return etcd3.utils.prefix_range_end(etcd3.utils.to_bytes(prefix))


def to_bytes(data: bytes | str) -> bytes:
    return etcd3.utils.to_bytes(data)


@dataclass(frozen=True)
class Compare:
    """One condition of a transaction: ``target`` of ``key`` compared with ``value``.

    Build with the class methods; ``target`` is ``"mod"``, ``"create"`` (revisions) or
    ``"value"``; ``op`` is ``"=="`` or ``"!="``.
    """

    key: bytes
    target: str
    value: int | bytes
    op: str = "=="

    @classmethod
    def mod_revision(cls, key: bytes | str, revision: int) -> Compare:
        """True when the key was last written at ``revision`` (0: the key does not exist)."""
        return cls(to_bytes(key), "mod", int(revision))

    @classmethod
    def absent(cls, key: bytes | str) -> Compare:
        """True when the key does not exist."""
        return cls(to_bytes(key), "create", 0)

    @classmethod
    def value_is(cls, key: bytes | str, value: bytes | str) -> Compare:
        return cls(to_bytes(key), "value", to_bytes(value))

    def message(self) -> etcdrpc.Compare:
        result = etcdrpc.Compare.EQUAL if self.op == "==" else etcdrpc.Compare.NOT_EQUAL
        if self.target == "mod":
            return etcdrpc.Compare(result=result, target=etcdrpc.Compare.MOD, key=self.key, mod_revision=self.value)
        if self.target == "create":
            return etcdrpc.Compare(result=result, target=etcdrpc.Compare.CREATE, key=self.key, create_revision=self.value)
        return etcdrpc.Compare(result=result, target=etcdrpc.Compare.VALUE, key=self.key, value=self.value)


@dataclass(frozen=True)
class Put:
    """Write ``value`` at ``key``, attached to ``lease`` (0: none)."""

    key: bytes | str
    value: bytes | str
    lease: int = 0


@dataclass(frozen=True)
class DeleteRange:
    """Delete ``key``, or every key in ``[key, range_end)`` when ``range_end`` is given."""

    key: bytes | str
    range_end: bytes | None = None

    @classmethod
    def prefix(cls, prefix: bytes | str) -> DeleteRange:
        return cls(prefix, prefix_end(prefix))


@dataclass(frozen=True)
class Range:
    """Read ``key`` or ``[key, range_end)``.

    ``revision`` > 0 reads the store as it was then; ``count_only`` returns only how many keys
    there are; ``limit`` caps the keys returned (``count`` still counts them all);
    ``descending`` returns the largest keys first.
    """

    key: bytes | str
    range_end: bytes | None = None
    revision: int = 0
    keys_only: bool = False
    count_only: bool = False
    limit: int = 0
    descending: bool = False

    @classmethod
    def prefix(cls, prefix: bytes | str, **kwargs) -> Range:
        return cls(prefix, prefix_end(prefix), **kwargs)

    def message(self) -> etcdrpc.RangeRequest:
        request = etcdrpc.RangeRequest(
            key=to_bytes(self.key), revision=self.revision, keys_only=self.keys_only, count_only=self.count_only,
            limit=self.limit,
        )  # fmt: skip
        if self.range_end is not None:
            request.range_end = self.range_end
        if self.descending:
            request.sort_order = etcdrpc.RangeRequest.DESCEND
            request.sort_target = etcdrpc.RangeRequest.KEY
        return request


Op = Union[Put, DeleteRange, Range]


@dataclass(frozen=True)
class RangeResult:
    """The keys a :class:`Range` found (none for ``count_only``), their count, and the revision
    the read was served at."""

    kvs: list[KeyValue]
    count: int
    revision: int


@dataclass(frozen=True)
class TxnResult:
    """Whether the conditions held, the store revision after the transaction, and one result per
    operation of the branch that ran: :class:`RangeResult` for a range, the number of deleted keys
    for a delete, ``None`` for a put."""

    succeeded: bool
    revision: int
    results: list[RangeResult | int | None]


def request_op(op: Op) -> etcdrpc.RequestOp:
    if isinstance(op, Put):
        return etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=to_bytes(op.key), value=to_bytes(op.value), lease=op.lease))
    if isinstance(op, DeleteRange):
        request = etcdrpc.DeleteRangeRequest(key=to_bytes(op.key))
        if op.range_end is not None:
            request.range_end = op.range_end
        return etcdrpc.RequestOp(request_delete_range=request)
    return etcdrpc.RequestOp(request_range=op.message())


def key_value(kv) -> KeyValue:
    """A protobuf ``KeyValue`` as ours."""
    return KeyValue(kv.key, kv.value, kv.mod_revision, kv.create_revision, kv.lease)


def range_result(response, revision: int) -> RangeResult:
    return RangeResult([key_value(kv) for kv in response.kvs], int(response.count), revision)
