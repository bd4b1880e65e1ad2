"""The rendezvous protocol's pure parts: the round record, node key order, and decide()."""

from __future__ import annotations

import random

import pytest
from torch.distributed.elastic.rendezvous import RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

from elastic_ddp.rendezvous.rounds import COMPLETE, LAST_CALL, RoundRecord, Seen, Step, decide, node_key

KEY = "/p/run/round"
NOW, LATER = 100.0, 700.0  # a deadline far away


def step(seen: Seen, min_nodes: int = 1, max_nodes: int = 3, now: float = NOW, deadline: float = LATER) -> Step:
    return decide(seen, min_nodes, max_nodes, now, deadline)[0]


# -- the round record ------------------------------------------------------------------------------


def test_round_record_round_trips_and_fills_completed_at_from_the_revision():
    record = RoundRecord(7, COMPLETE, closed=True, previous=3)
    decoded = RoundRecord.decode(record.encode(), KEY, mod_revision=42)
    assert decoded == RoundRecord(7, COMPLETE, closed=True, completed_at=42, previous=3)
    # Rewritten later (closed), the completion revision is carried, not replaced.
    assert RoundRecord.decode(decoded.encode(), KEY, mod_revision=50).completed_at == 42


def test_a_closing_reason_round_trips_and_an_ordinary_record_is_encoded_as_before():
    closed = RoundRecord(7, COMPLETE, closed=True, completed_at=42, reason="a worker's settings are invalid:\n  x.y")
    assert RoundRecord.decode(closed.encode(), KEY, mod_revision=50) == closed
    assert b"reason" not in RoundRecord(7, COMPLETE, closed=True).encode()  # nodes of older versions read it alike
    assert RoundRecord.decode(b'{"round":7,"state":"open","closed":true}', KEY, 1).reason == ""


def test_an_open_record_has_no_completion_revision():
    assert RoundRecord.decode(RoundRecord(3).encode(), KEY, mod_revision=9).completed_at == 0


@pytest.mark.parametrize("raw", [b"not json", b'{"state": "open"}', b'{"round": "x", "state": "open"}', b"[]"])
def test_a_corrupt_record_raises_state_error_naming_the_key(raw):
    with pytest.raises(RendezvousStateError, match=f"'{KEY}' is corrupt"):
        RoundRecord.decode(raw, KEY, 1)


def test_an_unknown_state_raises_state_error_naming_it():
    with pytest.raises(RendezvousStateError, match="state 'done'"):
        RoundRecord.decode(b'{"round": 1, "state": "done"}', KEY, 1)


# -- node keys sort like torch's node descriptors -----------------------------------------------------


def test_node_keys_sort_exactly_like_torchs_node_descriptors():
    rng = random.Random(0)
    alphabet = "0123456789abcdefghijklmnopqrstuvwxyz.-:_!\" #%/[]"
    addrs = ["10.0.0.1", "10.0.0.10", "10.0.0.1.x", "10.0.0.2", "node-1", "node-10", "node", "a b", "a!b", 'a"b', "é"]
    addrs += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))) for _ in range(300)]
    nodes = [_NodeDesc(a, rng.choice([1, 7, 99, 4_194_303]), rng.randint(0, 3000)) for a in addrs]
    by_torch = sorted(nodes)  # the order torch assigns ranks in
    by_key = sorted(nodes, key=lambda n: node_key(n.addr, n.pid, n.local_id).encode())  # etcd's byte order
    assert by_key == by_torch


def test_node_keys_are_readable_for_ordinary_addresses():
    assert node_key("10.1.2.3", 42, 0) == "10.1.2.3!0000000042!0000000000"


# -- decide ------------------------------------------------------------------------------------------


def test_no_record_creates_one():
    assert step(Seen(None)) is Step.CREATE


def test_an_open_round_is_registered_for_then_waited_on():
    assert step(Seen(RoundRecord(5))) is Step.REGISTER
    assert step(Seen(RoundRecord(5), registered=5, count=1), min_nodes=2) is Step.WAIT


def test_reaching_the_minimum_starts_the_last_call_and_the_maximum_completes_at_once():
    assert step(Seen(RoundRecord(5), registered=5, count=2), min_nodes=2) is Step.MARK_LAST_CALL
    assert step(Seen(RoundRecord(5), registered=5, count=3), min_nodes=2, max_nodes=3) is Step.COMPLETE
    assert step(Seen(RoundRecord(5, LAST_CALL), registered=5, count=3), min_nodes=2, max_nodes=3) is Step.COMPLETE


def test_the_last_call_completes_on_this_nodes_clock_only_when_due():
    seen = Seen(RoundRecord(5, LAST_CALL), registered=5, count=1, last_call_due=NOW + 2)
    assert step(seen) is Step.WAIT
    assert step(seen, now=NOW + 2) is Step.COMPLETE


def test_a_newcomer_waits_for_the_previous_rounds_nodes_before_the_last_call():
    record = RoundRecord(6, previous=2)  # opened by a newcomer after round 5 had 2 registrations
    assert step(Seen(record, registered=6, count=1, previous_left=2)) is Step.WAIT_FOR_PREVIOUS
    # One of round 5's nodes came over (or its lease ended): the group is moving.
    assert step(Seen(record, registered=6, count=2, previous_left=1)) is Step.MARK_LAST_CALL
    # A member of round 5 registering starts it at once.
    assert step(Seen(record, registered=6, count=2, previous_left=1, joined=5)) is Step.MARK_LAST_CALL


def test_a_round_completes_early_once_every_node_of_the_previous_round_came_over_or_left():
    record = RoundRecord(6, LAST_CALL, previous=3)
    assert step(Seen(record, registered=6, count=2, previous_left=0, last_call_due=NOW + 2)) is Step.COMPLETE
    # ... but not below the minimum.
    assert step(Seen(record, registered=6, count=2, previous_left=0, last_call_due=NOW + 2), min_nodes=3) is Step.WAIT


def test_a_completed_round_this_node_registered_for_is_checked_for_membership():
    assert step(Seen(RoundRecord(5, COMPLETE, completed_at=9), registered=5)) is Step.CHECK_MEMBERSHIP


def test_a_member_asking_for_a_new_round_opens_the_next_one():
    assert step(Seen(RoundRecord(5, COMPLETE, completed_at=9), registered=5, joined=5)) is Step.OPEN_NEXT


def test_a_newcomer_measures_a_completed_round_then_opens_the_next_or_waits_as_a_spare():
    record = RoundRecord(5, COMPLETE, completed_at=9)
    assert step(Seen(record)) is Step.MEASURE
    assert step(Seen(record, size=2), max_nodes=3) is Step.OPEN_NEXT
    assert step(Seen(record, size=3), max_nodes=3) is Step.WAIT_REDUNDANT
    assert step(Seen(record, size=3, member_left=True, spare=True), max_nodes=3) is Step.OPEN_NEXT


def test_a_node_rejected_from_a_completed_round_decides_like_a_newcomer():
    record = RoundRecord(5, COMPLETE, completed_at=9)
    assert step(Seen(record, registered=5, rejected=5, size=3), max_nodes=3) is Step.WAIT_REDUNDANT
    assert step(Seen(record, registered=5, rejected=5, size=1), max_nodes=3) is Step.OPEN_NEXT


def test_closed_rendezvous_fails_joining_and_lets_a_spare_exit_gracefully():
    closed = RoundRecord(5, COMPLETE, closed=True, completed_at=9)
    assert step(Seen(closed)) is Step.CLOSED
    assert step(Seen(closed, spare=True)) is Step.GRACEFUL_EXIT


def test_a_rendezvous_closed_with_a_reason_fails_every_node_spares_included_naming_it():
    closed = RoundRecord(5, COMPLETE, closed=True, completed_at=9, reason="bad settings")
    for seen in (Seen(closed), Seen(closed, spare=True), Seen(closed, registered=5, joined=5)):
        assert decide(seen, 1, 3, NOW, LATER) == (Step.CLOSED, "the rendezvous is closed: bad settings")


def test_the_join_timeout_applies_to_joining_but_not_to_a_spare():
    assert step(Seen(RoundRecord(5), registered=5, count=1), min_nodes=2, now=LATER + 1) is Step.TIMEOUT
    full = RoundRecord(5, COMPLETE, completed_at=9)
    assert step(Seen(full, size=3, spare=True), now=LATER + 1) is Step.WAIT_REDUNDANT


def test_every_decision_comes_with_a_reason():
    _, why = decide(Seen(RoundRecord(6, previous=2), registered=6, count=1, previous_left=2), 1, 3, NOW, LATER)
    assert "round 5" in why and "2" in why
