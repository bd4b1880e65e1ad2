"""The RendezvousBackend contract, checked against a real etcd (no mocks)."""

from __future__ import annotations

import threading
import time

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousStateError

from elastic_ddp.tools.etcd_server import free_port
from elastic_ddp.rendezvous.backend import EtcdV3RendezvousBackend
from elastic_ddp.etcd import EtcdClient


class RendezvousBackendContract:
    """Behaviour torch's DynamicRendezvousHandler relies on; subclasses provide ``backend``."""

    backend: EtcdV3RendezvousBackend

    def corrupt_state(self) -> None:
        raise NotImplementedError

    def set_state(self, state: bytes, token=None):
        result = self.backend.set_state(state, token)
        assert result is not None
        return result

    def test_get_state_returns_none_if_state_does_not_exist(self):
        assert self.backend.get_state() is None

    def test_get_state_returns_backend_state(self):
        self.backend.set_state(b"x")
        state, token = self.backend.get_state()
        assert state == b"x" and token is not None

    def test_get_state_raises_state_error_if_state_is_corrupt(self):
        self.corrupt_state()
        with pytest.raises(RendezvousStateError, match="corrupt"):
            self.backend.get_state()

    def test_set_state_sets_state_if_it_does_not_exist(self):
        state, token, has_set = self.set_state(b"x")
        assert (state, has_set) == (b"x", True) and token is not None

    def test_set_state_sets_state_if_token_is_current(self):
        _, token1, has_set1 = self.set_state(b"x")
        state2, token2, has_set2 = self.set_state(b"y", token1)
        assert state2 == b"y" and token1 != token2 and has_set1 and has_set2

    def test_set_state_returns_current_state_if_token_is_old(self):
        _, token1, _ = self.set_state(b"x")
        state2, token2, _ = self.set_state(b"y", token1)
        state3, token3, has_set = self.set_state(b"z", token1)
        assert (state3, token3, has_set) == (state2, token2, False)

    def test_set_state_returns_current_state_if_token_is_none_and_state_exists(self):
        state1, token1, _ = self.set_state(b"x")
        assert self.set_state(b"y") == (state1, token1, False)

    def test_set_state_returns_current_state_if_token_is_invalid(self):
        state1, token1, _ = self.set_state(b"x")
        assert self.set_state(b"y", token="invalid") == (state1, token1, False)
        assert self.set_state(b"y", token=object()) == (state1, token1, False)

    def test_set_state_returns_none_if_token_is_given_but_state_does_not_exist(self):
        assert self.backend.set_state(b"x", token=12345) is None

    def test_set_state_lets_exactly_one_of_two_writers_with_the_same_token_win(self):
        _, token, _ = self.set_state(b"start")
        results, barrier = {}, threading.Barrier(2)

        def write(value: bytes) -> None:
            barrier.wait()
            results[value] = self.backend.set_state(value, token)

        threads = [threading.Thread(target=write, args=(v,)) for v in (b"a", b"b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        winners = [v for v, (_, _, has_set) in results.items() if has_set]
        assert len(winners) == 1
        final_state, final_token = self.backend.get_state()
        assert final_state == winners[0]
        assert all(r[:2] == (final_state, final_token) for r in results.values())


class TestEtcdV3RendezvousBackend(RendezvousBackendContract):
    @pytest.fixture(autouse=True)
    def _backend(self, etcd_client, etcd_prefix):
        self.client = etcd_client
        self.backend = EtcdV3RendezvousBackend(etcd_client, "run1", key_prefix=etcd_prefix, ttl=60)

    def corrupt_state(self) -> None:
        self.client.put(self.backend.key, b"!!not base64!!")

    def test_name_is_etcd_v3(self):
        assert self.backend.name == "etcd-v3"

    def test_state_key_is_attached_to_a_lease_with_the_ttl(self):
        self.set_state(b"x")
        kv = self.client.get(self.backend.key)
        assert kv.lease != 0
        assert 0 < self.client.lease_ttl(kv.lease) <= 60

    def test_empty_run_id_is_refused(self, etcd_client):
        with pytest.raises(ValueError, match="run id"):
            EtcdV3RendezvousBackend(etcd_client, "")


def test_unreachable_etcd_raises_connection_error_within_read_timeout():
    read_timeout = 2
    client = EtcdClient(f"127.0.0.1:{free_port()}", timeout=read_timeout)
    backend = EtcdV3RendezvousBackend(client, "run")
    try:
        for call in (backend.get_state, lambda: backend.set_state(b"x")):
            start = time.monotonic()
            with pytest.raises(RendezvousConnectionError, match="The connection to etcd has failed") as info:
                call()
            # A correctness bound (the timeout is honoured), not a performance assertion.
            assert time.monotonic() - start < read_timeout + 5
            assert "127.0.0.1:" in str(info.value)
            assert not isinstance(info.value.__cause__, RendezvousConnectionError)
    finally:
        client.close()


def test_backend_fails_over_to_the_second_endpoint_when_the_first_is_dead(etcd_endpoint, etcd_prefix):
    client = EtcdClient(f"127.0.0.1:{free_port()},{etcd_endpoint}", timeout=3)
    try:
        backend = EtcdV3RendezvousBackend(client, "failover", key_prefix=etcd_prefix)
        state, token, has_set = backend.set_state(b"x")
        assert has_set and backend.get_state() == (b"x", token)
    finally:
        client.close()
