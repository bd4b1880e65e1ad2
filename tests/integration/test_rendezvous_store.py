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
from tests.helpers.nodes import record_raises, wait_for
from tests.helpers.proxy import TcpProxy


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


def test_get_raises_dist_store_error_saying_timeout_after_the_timeout(store):
    store.set_timeout(timedelta(seconds=1))
    start = time.monotonic()
    # torch's own store tests (and users' log searches) look for the word.
    with pytest.raises(dist.DistStoreError, match=r"[t -i]imeout.*'never'"):
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
        "from elastic_ddp.etcd import EtcdClient\n"
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


def test_wait_raises_dist_store_error_on_timeout_as_torchs_store_tests_expect(store):
    # torch's StoreTestBase._test_simple_wait, through the pybind trampoline as torch calls it.
    with pytest.raises(RuntimeError, match="[t -i]imeout"):
        store.wait(["bad_key"], timedelta(seconds=0.25))
    store.add("good_key", 1)
    store.wait(["good_key"])
    with pytest.raises(dist.DistStoreError, match="[t -i]imeout"):
        dist.PrefixStore("p", store).wait(["nope"], timedelta(milliseconds=1))


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


# -- clone, list_keys, many keys at once ------------------------------------------------------------


def test_a_clone_sees_the_same_keys_and_works_from_another_thread(store):
    twin = store.clone()
    assert isinstance(twin, dist.Store) and twin is not store
    store.set("foo", "bar")
    assert twin.get("foo") == b"bar"
    done = threading.Thread(target=lambda: twin.set("baz", "qux"))
    done.start()
    done.join(30)
    assert store.get("baz") == b"qux"
    assert twin.add("n", 2) == 2 and store.add("n", 3) == 5


def test_a_clone_made_by_torch_through_a_prefix_store_stays_usable(store):
    """torch 2.13 clones a group's store from C++ (e.g. when it shrinks a process group) and keeps
    only the C++ half; the Python half must stay alive or every call fails "Not implemented"."""
    import gc

    prefixed = dist.PrefixStore("group0/", store)
    prefixed.set("k", b"v")
    cloned = prefixed.clone()  # what distributed_c10d does: PrefixStore(..., store.clone())
    gc.collect()
    assert cloned.get("k") == b"v"
    cloned.set("k2", b"v2")
    assert prefixed.get("k2") == b"v2"


def test_list_keys_returns_every_key_of_the_store_and_no_others(store, etcd_client, etcd_prefix):
    store.set("foo", "1")
    store.add("bar", 1)  # an add also writes its ledger key, which is no store key
    dist.PrefixStore("round-1", store).set("MASTER_ADDR", "h")
    etcd_client.put(f"{etcd_prefix}/other", b"x")  # beside the store's prefix
    assert sorted(store.list_keys()) == ["bar", "foo", "round-1/MASTER_ADDR"]
    assert store.num_keys() == 3


def test_multi_get_and_multi_set_handle_more_keys_than_one_transaction_may_hold(store):
    keys = [f"role_info/{i}" for i in range(300)]  # what torch's agent on rank 0 does at 300 nodes
    store.multi_set(keys, [str(i).encode() for i in range(300)])
    assert store.multi_get(keys[::-1]) == [str(i).encode() for i in range(299, -1, -1)]
    store.wait(keys, timedelta(seconds=5))
    assert store.check(keys) and not store.check([*keys, "absent"])


def test_multi_get_reads_keys_with_many_others_between_them(store, monkeypatch):
    store.multi_set([f"m/{i:03d}" for i in range(200)], [b"x"] * 200)  # sort between "m/" and "m/zz"
    store.multi_set(["m/", "m/zz"], [b"first", b"last"])
    spans = []
    read = store._client.range
    monkeypatch.setattr(store._client, "range", lambda request: spans.append(request) or read(request))
    assert store.multi_get(["m/zz", "m/"]) == [b"last", b"first"]
    # The span held 202 keys for 2 wanted: read one by one instead (pinned to one revision).
    assert spans[0].limit and [r.key for r in spans[1:]] == [store._key("m/zz"), store._key("m/")]


def test_deleting_a_range_of_rounds_takes_their_add_ledger_along(store, etcd_client):
    for round_ in (1, 2, 3):
        dist.PrefixStore(f"round-{round_:012d}", store).add("barrier", 1)
    etcd_client.txn([], store.delete_range_ops("round-", f"round-{3:012d}"))
    assert store.list_keys() == [f"round-{3:012d}/barrier"]
    everything = [kv.key.decode() for kv in etcd_client.get_prefix(store.prefix.rstrip("/"))]
    assert len(everything) == 2 and all(f"round-{3:012d}" in key for key in everything), everything


# -- add across failover -------------------------------------------------------------------------


class ReplyCutter(TcpProxy):
    """A TCP proxy in front of etcd that forwards every request and, once armed, cuts the
    connection right after forwarding the first request carrying ``marker`` -- before etcd's reply
    to it can come back. The request is applied; the client only sees a dropped connection."""

    def __init__(self, upstream: tuple[str, int], marker: bytes) -> None:
        self.marker = marker
        self.armed = threading.Event()
        self.cut = threading.Event()
        super().__init__(upstream)

    def forward(self, data: bytes, to_server: bool, target) -> bool:
        if not to_server and self.cut.is_set():
            return False  # the reply never reaches the client
        if to_server and self.armed.is_set() and self.marker in data and not self.cut.is_set():
            self.cut.set()  # before forwarding: the reply cannot overtake the flag
            target.sendall(data)
            time.sleep(0.3)  # etcd applies the request meanwhile
            return False
        target.sendall(data)
        return True


def test_an_add_whose_reply_is_lost_is_applied_once_after_failover(etcd_endpoint, etcd_prefix):
    from elastic_ddp.etcd import EtcdClient, parse_endpoints

    proxy = ReplyCutter(parse_endpoints(etcd_endpoint)[0], marker=b"1234567")
    # The proxy first (the client starts there), the same etcd directly second (the failover).
    client = EtcdClient(f"127.0.0.1:{proxy.port},{etcd_endpoint}", timeout=5)
    s = EtcdV3Store(client, f"{etcd_prefix}/failover", timeout=5, lease_ttl=60)
    try:
        s.set("counter", b"1000000")
        proxy.armed.set()
        assert s.add("counter", 234567) == 1234567
        assert proxy.cut.is_set(), "the proxy never cut a reply: the test did not test anything"
        assert s.get("counter") == b"1234567"  # a second application would read 1469134
        assert s.add("counter", 1) == 1234568
    finally:
        s.close()
        client.close()
        proxy.close()


def test_a_blocking_get_rides_out_etcd_being_down_until_its_own_timeout(tmp_path, monkeypatch):
    from elastic_ddp.tools.etcd_server import EtcdServer
    from elastic_ddp.etcd import EtcdClient, EtcdConnectionError

    with EtcdServer(tmp_path / "etcd") as own, EtcdClient(own.endpoint, timeout=1) as client:
        waiting = EtcdV3Store(client, "/ride-out/", timeout=timedelta(seconds=60), lease_ttl=60)
        got: list = []
        failed = record_raises(monkeypatch, client, "range", EtcdConnectionError)
        own.stop()
        reader = threading.Thread(target=lambda: got.append(waiting.get("MASTER_ADDR")), daemon=True)
        reader.start()
        wait_for(lambda: len(failed) >= 2, 30, what="two reads that etcd did not answer")
        assert reader.is_alive()
        own.start()
        with EtcdClient(own.endpoint) as other:
            writer = EtcdV3Store(other, "/ride-out/", lease_ttl=60)
            writer.set("MASTER_ADDR", "node-0")
            reader.join(30)
            writer.close()
        assert got == [b"node-0"]
        waiting.close()
