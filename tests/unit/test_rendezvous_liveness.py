"""The liveness probe: a refused connection, and only that, proves a node's agent gone."""

from __future__ import annotations

import socket
import threading

from elastic_ddp.rendezvous.liveness import LivenessListener, parse_address, probe
from tests.helpers.nodes import wait_for


def test_a_listening_agent_is_alive_and_a_closed_one_is_gone():
    alive, dead = LivenessListener("127.0.0.1"), LivenessListener("127.0.0.1")
    try:
        dead.close()
        addresses = {b"alive": parse_address(alive.address), b"dead": parse_address(dead.address)}
        assert probe(addresses, timeout=5) == [b"dead"]
    finally:
        alive.close()


def test_no_answer_proves_nothing():
    # A host that drops packets (down, or unreachable) is not declared gone; a listener whose
    # backlog is full stands in for it: connecting times out instead of being refused.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(0)
        fillers = []
        try:
            for _ in range(8):
                filler = socket.socket()
                filler.setblocking(False)
                filler.connect_ex(silent.getsockname())
                fillers.append(filler)
            assert probe({b"silent": silent.getsockname()}, timeout=0.3) == []
        finally:
            for filler in fillers:
                filler.close()


def test_addresses_are_read_back_as_written():
    listener = LivenessListener("::1" if socket.has_ipv6 else "127.0.0.1")
    try:
        host, port = parse_address(listener.address)
        assert (host, port) == (listener.host, listener.port)
    finally:
        listener.close()
    assert parse_address("node-7.cluster.local:4242") == ("node-7.cluster.local", 4242)
    assert parse_address("no-port") is None and parse_address(":12") is None and parse_address("h:x") is None


def test_listeners_share_one_thread_which_ends_with_the_last_of_them():
    def ours():
        return [t for t in threading.enumerate() if t.name == "rdzv-liveness"]

    listeners = [LivenessListener("127.0.0.1") for _ in range(50)]
    assert len(ours()) == 1
    assert probe({str(i).encode(): ("127.0.0.1", l.port) for i, l in enumerate(listeners)}, timeout=5) == []
    for listener in listeners:
        listener.close()
    wait_for(lambda: not ours(), 10, what="the liveness thread to end")
