"""The etcd client's long-lived parts against a real etcd: the resumable watch stream, lease
keep-alive, compaction."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from elastic_ddp.tools.etcd_server import EtcdServer
from elastic_ddp.etcd import (
    EtcdClient, EtcdCompactedError, LeaseKeepAlive, Range, WatchEvent, WatchStream, parse_endpoints,
)  # fmt: skip
from tests.helpers.nodes import wait_for
from tests.helpers.proxy import TcpProxy


class Collector:
    def __init__(self) -> None:
        self.events: list[WatchEvent] = []
        self.resyncs = 0
        self._lock = threading.Lock()

    def __call__(self, events: list[WatchEvent]) -> None:
        with self._lock:
            self.events += events

    def resync(self) -> None:
        self.resyncs += 1

    def keys(self, kind: str | None = None) -> list[bytes]:
        with self._lock:
            return [e.key for e in self.events if kind is None or e.kind == kind]


def test_a_watch_delivers_from_its_start_revision_and_resumes_after_a_restart_without_a_gap(tmp_path):
    with EtcdServer(tmp_path / "etcd") as etcd, EtcdClient(etcd.endpoint, timeout=5) as client:
        client.put("/w/before", "0")
        start = client.range(Range("/w/")).revision  # changes after this read must all arrive
        client.put("/w/a", "1")
        stream, seen = WatchStream(client), Collector()
        try:
            stream.watch("/w/", seen, start_revision=start + 1, prefix=True)
            client.put("/w/b", "2")
            wait_for(lambda: seen.keys() == [b"/w/a", b"/w/b"], 10, what="the first two changes")
            etcd.stop()
            time.sleep(2)
            etcd.start()
            client.put("/w/c", "3")
            client.delete("/w/a")
            wait_for(lambda: len(seen.keys()) == 4, 30, what="the changes after the restart")
            assert seen.keys() == [b"/w/a", b"/w/b", b"/w/c", b"/w/a"]  # once each, in order
            assert [e.kind for e in seen.events] == ["put", "put", "put", "delete"]
        finally:
            stream.close()


def test_a_deletions_only_watch_reports_what_was_deleted_and_when_it_was_created(etcd_client, etcd_prefix):
    stream, seen = WatchStream(etcd_client), Collector()
    try:
        start = etcd_client.range(Range(etcd_prefix)).revision
        stream.watch(f"{etcd_prefix}/", seen, start_revision=start + 1, prefix=True, no_put=True, prev_kv=True)
        created = etcd_client.put(f"{etcd_prefix}/gone", "x")
        etcd_client.put(f"{etcd_prefix}/stays", "y")
        etcd_client.delete(f"{etcd_prefix}/gone")
        wait_for(lambda: seen.keys(), 10, what="the deletion")
        time.sleep(0.2)  # a put delivered in error would arrive with the deletion
        assert [(e.kind, e.key, e.prev.create_revision) for e in seen.events] == [
            ("delete", f"{etcd_prefix}/gone".encode(), created)
        ]
    finally:
        stream.close()


def test_a_watch_from_a_compacted_revision_asks_its_owner_to_read_again_and_goes_on(etcd_client, etcd_prefix):
    old = etcd_client.put(f"{etcd_prefix}/k", "1")
    etcd_client.put(f"{etcd_prefix}/k", "2")
    now = etcd_client.range(Range(etcd_prefix)).revision
    etcd_client._raw.compact(now)  # test setup only: compaction has no wrapper
    with pytest.raises(EtcdCompactedError):
        etcd_client.range(Range(f"{etcd_prefix}/k", revision=old))
    stream, seen = WatchStream(etcd_client), Collector()
    try:
        stream.watch(f"{etcd_prefix}/", seen, start_revision=old, prefix=True, on_resync=seen.resync)
        wait_for(lambda: seen.resyncs == 1, 10, what="the resync")
        etcd_client.put(f"{etcd_prefix}/k", "3")
        wait_for(lambda: b"3" in [e.value for e in seen.events], 10, what="the change after the resync")
    finally:
        stream.close()


def test_keep_alive_renews_a_lease_past_its_ttl_and_reports_one_that_ended(etcd_client, etcd_prefix):
    keep, ended = LeaseKeepAlive(etcd_client, deadline=1.0), []
    try:
        lease = etcd_client.grant_lease(2)
        etcd_client.put(f"{etcd_prefix}/leased", "x", lease=lease)
        keep.add(lease, 0.5, ended.append)
        time.sleep(3)  # longer than the TTL
        assert etcd_client.get(f"{etcd_prefix}/leased") is not None and ended == []
        etcd_client.revoke_lease(lease)  # someone else ended it
        wait_for(lambda: ended == [lease], 10, what="the ended lease to be reported")
    finally:
        keep.close()


class Silence(TcpProxy):
    """A TCP proxy in front of etcd that, once muted, forwards requests but no replies and keeps the
    connection open: a member that stopped answering without the network saying so."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.muted = threading.Event()
        super().__init__(upstream)

    def forward(self, data: bytes, to_server: bool, target: socket.socket) -> bool:
        if to_server or not self.muted.is_set():
            target.sendall(data)
        return True


def test_keep_alive_moves_to_another_member_when_its_member_stops_answering(etcd_endpoint, etcd_prefix):
    proxy = Silence(parse_endpoints(etcd_endpoint)[0])
    client = EtcdClient(f"127.0.0.1:{proxy.port},{etcd_endpoint}", timeout=5)  # the silent one first
    keep = LeaseKeepAlive(client, deadline=1.0)
    try:
        lease = client.grant_lease(3)
        client.put(f"{etcd_prefix}/leased", "x", lease=lease)
        keep.add(lease, 0.5)
        time.sleep(1)
        proxy.muted.set()
        time.sleep(6)  # two TTLs: renewals on the silent member alone would have let it expire
        with EtcdClient(etcd_endpoint, timeout=5) as direct:
            assert direct.get(f"{etcd_prefix}/leased") is not None
            assert direct.lease_ttl(lease) > 0
    finally:
        keep.close()
        client.close()
        proxy.close()


def test_a_read_only_transaction_is_sent_as_range_reads_of_one_revision(etcd_client, etcd_prefix, monkeypatch):
    # etcd before 3.5.5 (the bundled one is 3.5.1) crashes when a client's deadline cancels a
    # read-only Txn while it is served (etcd-io/etcd#14110): such a txn must never be sent.
    prefix = f"{etcd_prefix}/read-only/"
    for i in range(3):
        etcd_client.put(f"{prefix}a/{i}", "x")
    etcd_client.put(f"{prefix}b/0", "x")

    def no_txn(*args, **kwargs):
        raise AssertionError("a read-only Txn request was sent")

    monkeypatch.setattr(etcd_client._raw.kvstub, "Txn", no_txn)
    read, reads = etcd_client.range, []

    def read_then_write(request: Range):
        result = read(request)
        if not reads:
            etcd_client.put(f"{prefix}b/1", "x")  # lands between the two reads
        reads.append(request)
        return result

    monkeypatch.setattr(etcd_client, "range", read_then_write)
    result = etcd_client.txn([], [Range.prefix(f"{prefix}a/", count_only=True), Range.prefix(f"{prefix}b/", count_only=True)])
    assert result.succeeded and [r.count for r in result.results] == [3, 1]  # both as of the first read
    assert reads[1].revision == result.revision == result.results[0].revision
    monkeypatch.undo()
    assert etcd_client.range(Range.prefix(f"{prefix}b/", count_only=True)).count == 2
