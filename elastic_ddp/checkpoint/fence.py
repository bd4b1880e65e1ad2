"""Commit fencing: only the newest worker group of a run may commit checkpoints into its URL.

A group that was cut off by a network partition (or frozen, then thawed) can still reach the
checkpoint storage after the rest of the job re-formed without it. If it went on committing, it
could replace a manifest the new group wrote, or delete files of a save the new group has in
flight. Every worker group is formed in one rendezvous round, and rounds only grow, so the round
names a group:

* When a group starts, its rank 0 *claims* the run by writing ``{url}/fence.json`` with its round.
  A group starts only after its round was agreed in etcd, so a claim by a started group is always
  the newest one -- including after the rendezvous state was reset and rounds start again at 0.
* Before rank 0 deletes a leftover directory or writes a manifest, it *checks* the fence: if the
  fence names another round, this group is a stale writer; the save fails with
  :class:`StaleWriterError` and nothing is written or removed.

What is left: a stale writer that passed the check in the moments before a new group's claim
still commits once -- a checkpoint whose every file matches its manifest, of a step the stale
group really trained, so nothing corrupt is left behind. An etcd lease would close that window at
the price of making commits depend on etcd being up; this package prefers saves that survive an
etcd outage (docs/reliability.md).
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

from elastic_ddp.checkpoint.storage import Storage, join

FENCE_NAME = "fence.json"


class StaleWriterError(RuntimeError):
    """This group's round is not the one that owns the run's checkpoints: it must not commit."""


def claim(storage: Storage, round_: int) -> None:
    """Record rendezvous round ``round_`` as the owner of ``storage.url`` (rank 0, at group start)."""
    record = {"round": round_, "time": time.time(), "host": socket.gethostname()}
    storage.makedirs(storage.url)
    storage.write_bytes_atomic(join(storage.url, FENCE_NAME), json.dumps(record).encode())


def owner(storage: Storage) -> dict[str, Any] | None:
    """The fence record, or None where no group has claimed the URL (or it is unreadable)."""
    url = join(storage.url, FENCE_NAME)
    if not storage.exists(url):
        return None
    try:
        record = json.loads(storage.read_bytes(url))
        return record if isinstance(record, dict) and isinstance(record.get("round"), int) else None
    except ValueError:
        return None


def check(storage: Storage, round_: int, action: str) -> None:
    """Raise :class:`StaleWriterError` unless round ``round_`` owns ``storage.url``.

    ``action`` says what was about to happen, for the message. A missing or unreadable fence does
    not stop anyone: it is only missing for runs that never claimed one (no rendezvous round).
    """
    record = owner(storage)
    if record is None or record["round"] == round_:
        return
    raise StaleWriterError(
        f"Refusing to {action}: {join(storage.url, FENCE_NAME)} says the worker group of rendezvous round "
        f"{record['round']} (started on {record.get('host', '?')}) owns this run's checkpoints, and this group "
        f"was formed in round {round_}. A newer group has taken over; this one is a stale writer (cut off "
        "from the job, or frozen and resumed) and will not write."
    )
