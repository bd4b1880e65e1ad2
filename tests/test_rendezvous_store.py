"""EtcdV3Store against a real etcd: c10d Store semantics torch's rendezvous and agent use."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.utils.store import barrier, synchronize

from elastic_ddp.rendezvous.store import EtcdV3Store


@pytest.fixture
def store(etcd_client, etcd_prefix):
    s = EtcdV3Store(etcd_client, f"{etcd_prefix}/store", timeout=timedelta(seconds=5), lease_ttl=60)
    try:
        yield s
    finally:
        s.close()


def test_set_then_get_returns_the_value(store):
    store.set("k", b"v")
    store.set("s", "text")
    assert store.get("k") == b"v" and store.get("s") == b"text"


def test_get_waits_for_a_key_set_later_by_another_thread(store):
    timer = threading.Timer(0.5, store.set, args=("late", b"1"))
    timer.start()
    try:
        assert store.get("late") == b"1"
    finally:
        timer.cancel()


def test_get_raises_dist_store_error_after_the_timeout(store):
    store.set_timeout(timedelta(seconds=1))
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="missing|never"):
        store.get("never")
    assert 0.9 < time.monotonic() - start < 6


def test_add_from_threads_sums_exactly(store):
    def add_many():
        for _ in range(10):
            store.add("counter", 1)

    threads = [threading.Thread(target=add_many) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert store.add("counter", 0) == 40


def test_add_from_processes_sums_exactly(store, etcd_endpoint):
    script = (
        "import sys\n"
        "from elastic_ddp.rendezvous.client import EtcdClient\n"
        "from elastic_ddp.rendezvous.store import EtcdV3Store\n"
        "s = EtcdV3Store(EtcdClient(sys.argv[1]), sys.argv[2], timeout=30)\n"
        "s.wait(['go'])\n"
        "for _ in range(15): s.add('counter', 2)\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", script, etcd_endpoint, store.prefix]) for _ in range(2)
    ]
    try:
        store.set("go", b"1")  # both start adding at about the same time
        for _ in range(5):
            store.add("counter", 2)
        assert [p.wait(60) for p in procs] == [0, 0]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert int(store.get("counter")) == 2 * (15 + 15 + 5)


def test_add_on_a_non_integer_value_names_the_value(store):
    store.set("text", b"abc")
    with pytest.raises(ValueError, match="abc"):
        store.add("text", 1)


def test_compare_set_follows_c10d_semantics(store):
    assert store.compare_set("k", "", "first") == b"first"  # missing + empty expected: set
    assert store.compare_set("k", "first", "second") == b"second"  # match: set
    assert store.compare_set("k", "wrong", "third") == b"second"  # mismatch: current value
    assert store.compare_set("missing", "x", "y") == b"x"  # missing + non-empty expected
    assert not store.check(["missing"])


def test_wait_returns_when_keys_are_set_later_by_another_thread(store):
    def later():
        store.set("a", b"1")
        store.set("b", b"2")

    timer = threading.Timer(0.3, later)
    timer.start()
    try:
        start = time.monotonic()
        store.wait(["a", "b"], timedelta(seconds=10))
        assert time.monotonic() - start < 9
    finally:
        timer.cancel()


def test_wait_raises_dist_store_error_on_timeout(store):
    with pytest.raises(dist.DistStoreError):
        store.wait(["nope"], timedelta(milliseconds=1))


def test_check_delete_key_and_num_keys(store):
    assert store.num_keys() == 0
    store.set("a", b"1")
    store.set("b", b"2")
    assert store.check(["a", "b"]) and not store.check(["a", "c"])
    assert store.num_keys() == 2
    assert store.delete_key("a") is True
    assert store.delete_key("a") is False
    assert store.num_keys() == 1


def test_multi_set_and_multi_get(store):
    store.multi_set(["x", "y"], [b"1", b"2"])
    assert store.multi_get(["y", "x"]) == [b"2", b"1"]


def test_keys_are_attached_to_a_live_lease(store, etcd_client):
    store.set("leased", b"1")
    kv = etcd_client.get(f"{store.prefix}leased")
    assert kv.lease != 0
    assert 0 < etcd_client.lease_ttl(kv.lease) <= 60


def test_revoking_the_lease_deletes_the_keys(store):
    store.set("gone", b"1")
    store.close(revoke=True)
    assert not store.check(["gone"])


def test_works_through_prefix_store_as_torch_uses_it(store):
    ps = dist.PrefixStore("torch.rendezvous.run.0", store)
    ps.set("MASTER_ADDR", b"host")
    assert ps.get("MASTER_ADDR") == b"host"
    assert ps.add("n", 3) == 3
    assert ps.compare_set("c", "", "v") == b"v"
    assert ps.delete_key("c") is True
    assert ps.num_keys() == 2
    ps.wait(["MASTER_ADDR"])
    with pytest.raises(dist.DistStoreError):
        ps.wait(["absent"], timedelta(milliseconds=1))


def test_agent_exit_barrier_and_synchronize_work(store):
    ps = dist.PrefixStore("agent", store)
    barrier(ps, world_size=1, key_prefix="exit_barrier", barrier_timeout=10)
    assert synchronize(ps, b"data", rank=0, world_size=1, key_prefix="sync") == [b"data"]


def test_rendezvous_store_info_round_trips_through_the_store(store):
    from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo

    ps = dist.PrefixStore("torch.rendezvous.run.1", store)
    info = RendezvousStoreInfo.build(0, ps, local_addr="127.0.0.1", server_port=12345)
    assert (info.master_addr, info.master_port) == ("127.0.0.1", 12345)
