"""The rendezvous protocol's data and decisions, without I/O: what is stored, and what a node does next.

A run's rendezvous is one small *round record* plus one key per node that registered for a round
(layout in :mod:`elastic_ddp.rendezvous.view`):

* The round record (``<run>/round``, JSON, a few dozen bytes) says which round is current and
  how far it got: ``open`` (nodes register), ``last_call`` (``min_nodes`` registered; the round
  completes when ``last_call_timeout`` has passed on the clock of the node that said so, or as
  soon as ``max_nodes`` registered), ``complete``, and whether the rendezvous is ``closed`` --
  with a ``reason`` when the job must end on every node (a worker's settings are invalid: no
  restart can fix them), which every node then exits with, spares included.
  Every change of it is one compare-and-set on its revision. A round opened after a completed
  one also records how many registrations that one had (``previous``).
* A node registers for round R by writing ``<run>/joins/<R>/<node>`` under its own lease. The
  members of a completed round are the registrations that existed at the revision of the write
  that completed it (``completed_at``), at most ``max_nodes`` of them; a node's rank is the number
  of member keys that sort before its own. A node that finds round R complete and full registers
  for R as well, as a *spare*: its key is newer than ``completed_at``, so it is no member.

The previous round's registrations tell a round who is still expected. A node that arrives while
a group trains opens the next round, but that round's last call starts only once a node of the
previous round has come over (or left): the newcomer alone must not form a round while the group
is still stopping its workers to admit it -- torch's wait list has the same effect. And a round
completes as soon as every registration of the previous round has moved to it or ended, without
waiting out the last call: after a preemption, a crash, or a join, everyone expected is there.
Spares are among those registrations, so the members left after a departure wait for them.
Only a node that vanished without a trace (its lease still running) makes the others wait the
last call.

Node keys sort the way torch orders its ``_NodeDesc`` (address, then pid, then a per-process
counter), so ranks follow torch's rule: given the same set of members, every node computes the
same ranks, and a member keeps its place relative to the others across rounds. The key encoding
(:func:`node_key`) keeps that order under etcd's byte-wise key order.

:func:`decide` is the whole state machine: a pure function of what the node has seen, the time,
and the settings, returning the next step and why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from enum import Enum

from torch.distributed.elastic.rendezvous import RendezvousStateError

__all__ = ["MAX_REASON_LENGTH", "OPEN", "LAST_CALL", "COMPLETE", "RoundRecord", "Seen", "Step", "decide", "node_key"]

OPEN, LAST_CALL, COMPLETE = "open", "last_call", "complete"
_STATES = (OPEN, LAST_CALL, COMPLETE)
# A closed record's reason is written once and sent to every node: it stays one small value.
MAX_REASON_LENGTH = 2000


@dataclass(frozen=True)
class RoundRecord:
    """The value of a run's round key.

    ``completed_at`` is the revision whose registrations form the round (0 in a record that is
    not complete yet, and in the record written by the completing compare-and-set itself, whose
    own revision is meant: it is not known before the write). Later rewrites of a complete
    record (closing it) carry it explicitly. ``reason`` (only in a closed record, at most
    :data:`MAX_REASON_LENGTH` characters): why the job ends on every node; empty for an ordinary
    close (a node whose job finished), after which the others finish on their own.
    """

    round: int
    state: str = OPEN
    closed: bool = False
    completed_at: int = 0
    previous: int = 0  # registrations of the round before, at its completion (0: none or unknown)
    reason: str = ""

    def encode(self) -> bytes:
        body = {"round": self.round, "state": self.state, "closed": self.closed}
        if self.completed_at:
            body["completed_at"] = self.completed_at
        if self.previous:
            body["previous"] = self.previous
        if self.reason:
            body["reason"] = self.reason
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes, key: str, mod_revision: int) -> RoundRecord:
        """Parse a stored record; ``mod_revision`` resolves an implicit ``completed_at``.

        Raises:
            RendezvousStateError: the value is not a round record (naming the key).
        """
        try:
            body = json.loads(raw)
            record = cls(int(body["round"]), str(body["state"]), bool(body.get("closed", False)),
                         int(body.get("completed_at", 0)), int(body.get("previous", 0)),
                         str(body.get("reason", "")))  # fmt: skip
        except (ValueError, TypeError, KeyError) as exc:
            raise RendezvousStateError(
                f"The rendezvous round record at etcd key '{key}' is corrupt ({raw[:80]!r}); expected JSON "
                "with 'round' and 'state'. Delete the key to start the rendezvous afresh."
            ) from exc
        if record.state not in _STATES or record.round < 0:
            raise RendezvousStateError(
                f"The rendezvous round record at etcd key '{key}' has round {record.round} and state "
                f"'{record.state}'; expected a round >= 0 and one of {', '.join(_STATES)}."
            )
        if record.state == COMPLETE and not record.completed_at:
            record = replace(record, completed_at=mod_revision)
        return record


def node_key(addr: str, pid: int, local_id: int) -> str:
    """The name of a node's registration key; byte order of names = torch's order of nodes.

    Bytes of the address up to ``"`` are escaped as ``"`` and two hex digits, and ``!`` ends the
    address: escapes sort below every unescaped byte and ``!`` below every escape, so a shorter
    address sorts before a longer one it is a prefix of -- the order of Python's ``str``
    comparison (UTF-8 keeps code point order). pid and counter are zero-padded decimals.
    Host names and addresses never contain escaped bytes; the escape only keeps odd
    ``--local-addr`` values correct.
    """
    escaped = "".join(f'"{b:02x}' if b <= 0x22 else chr(b) for b in addr.encode())
    return f"{escaped}!{pid:010d}!{local_id:010d}"


class Step(Enum):
    """What a node joining a round does next (see :func:`decide`)."""

    CREATE = "create the round record"
    REGISTER = "register for the current round"
    OPEN_NEXT = "open the next round and register for it"
    MARK_LAST_CALL = "start the last call"
    COMPLETE = "complete the round"
    MEASURE = "read how many members the completed round has"
    CHECK_MEMBERSHIP = "read this node's rank in the completed round"
    WAIT = "wait for the round to change"
    WAIT_FOR_PREVIOUS = "wait for a node of the previous round to come over"
    WAIT_REDUNDANT = "wait as a spare node"
    TIMEOUT = "give up: join timeout"
    CLOSED = "give up: the rendezvous is closed"
    GRACEFUL_EXIT = "exit: the rendezvous closed while this node was a spare"


@dataclass(frozen=True)
class Seen:
    """What a node knows when it decides; all of it came from etcd or from its own writes.

    Attributes:
        record: The newest round record seen (None: there is none).
        registered: The round this node has a registration key in (None: none).
        count: Registrations in ``registered`` as last read by this node (at the latest in the
            transaction of its own registration); None when unknown.
        previous_left: Registrations of the round before ``registered`` still there, read
            together with ``count`` (None when unknown or when there was no such round).
        joined: The last round this node was a member of: calling for a new rendezvous means it
            wants a round after that one.
        rejected: A completed round this node registered for and is not a member of.
        size: Members of ``record.round`` (known after MEASURE or CHECK_MEMBERSHIP).
        member_left: A member of the completed ``record.round`` is gone (for a spare node).
        last_call_due: Monotonic time at which this node completes the round in last call.
        spare: This node waits as a spare (the round is full).
    """

    record: RoundRecord | None
    registered: int | None = None
    count: int | None = None
    previous_left: int | None = None
    joined: int | None = None
    rejected: int | None = None
    size: int | None = None
    member_left: bool = False
    last_call_due: float | None = None
    spare: bool = False


def decide(seen: Seen, min_nodes: int, max_nodes: int, now: float, deadline: float) -> tuple[Step, str]:
    """The next step of a node that wants to be in a completed round, and the reason in words.

    ``now`` and ``deadline`` are monotonic seconds; ``deadline`` is the join timeout's (a spare
    node is not bound by it, as in torch).
    """
    record = seen.record
    if record is None:
        if now > deadline:
            return Step.TIMEOUT, "no round record appeared before the join timeout"
        return Step.CREATE, "there is no round record yet"
    r = record.round
    if record.closed:
        if record.reason:  # the job ends with an error on every node, spares included
            return Step.CLOSED, f"the rendezvous is closed: {record.reason}"
        if seen.spare:
            return Step.GRACEFUL_EXIT, f"the rendezvous closed while this node waited as a spare of round {r}"
        return Step.CLOSED, "the rendezvous is closed"
    if record.state == COMPLETE:
        if seen.registered == r and seen.rejected != r and seen.joined != r:
            return Step.CHECK_MEMBERSHIP, f"round {r}, which this node registered for, is complete"
        if seen.joined == r:
            why = f"this node was a member of round {r} and needs a new round"
        elif seen.size is None:
            return Step.MEASURE, f"round {r} is complete without this node; is it full?"
        elif seen.size < max_nodes:
            why = f"round {r} has {seen.size} of at most {max_nodes} members; this node joins the next"
        elif seen.member_left:
            why = f"a member of the full round {r} is gone; this spare node joins the next round"
        else:
            return Step.WAIT_REDUNDANT, f"round {r} is full ({seen.size} members); waiting as a spare"
        if now > deadline:
            return Step.TIMEOUT, f"the next round after {r} did not form before the join timeout"
        return Step.OPEN_NEXT, why
    if now > deadline:
        return Step.TIMEOUT, f"round {r} did not complete before the join timeout"
    if seen.registered != r:
        return Step.REGISTER, f"round {r} is {record.state.replace('_', ' ')}"
    count = seen.count or 0
    if count >= max_nodes:
        return Step.COMPLETE, f"{count} nodes registered for round {r}, the maximum ({max_nodes})"
    if count >= min_nodes and record.previous and seen.previous_left == 0:
        return Step.COMPLETE, (
            f"{count} nodes registered for round {r} and every node of round {r - 1} has come over or left"
        )
    if record.state == OPEN and count >= min_nodes:
        if not record.previous or seen.joined == r - 1:
            return Step.MARK_LAST_CALL, f"{count} nodes registered for round {r}, at least the minimum ({min_nodes})"
        if seen.previous_left is not None and seen.previous_left < record.previous:
            return Step.MARK_LAST_CALL, (
                f"{count} nodes registered for round {r}, at least the minimum ({min_nodes}), and round {r - 1}'s "
                "nodes are moving"
            )
        return Step.WAIT_FOR_PREVIOUS, (
            f"round {r} has its minimum of nodes, but none of the {record.previous} of round {r - 1} has come over "
            "yet (they are stopping their workers)"
        )
    if record.state == LAST_CALL and seen.last_call_due is not None and now >= seen.last_call_due:
        return Step.COMPLETE, f"the last call of round {r} is over"
    return Step.WAIT, f"round {r} is {record.state.replace('_', ' ')} with this node registered"
