"""Proof that every node sees the same checkpoint storage (collective).

A local ``checkpoint.url`` on several machines is the quiet way to lose a job: each node writes its
own part of every checkpoint, no node ever holds a whole one, and every resume starts over. So,
before training: rank 0 writes a probe file with a random token under the URL, one rank per node
reads it back under *its own* idea of the URL (a relative path resolves per working directory),
rank 0 removes it, and every rank learns the verdict. Cost: one small write, one small read per
node, one delete, two broadcasts and a gather.
"""

from __future__ import annotations

import logging
import os
import secrets

from elastic_ddp.checkpoint.collectives import Collectives
from elastic_ddp.checkpoint.errors import CheckpointError
from elastic_ddp.checkpoint.storage import Storage, StorageError, join

log = logging.getLogger("elastic_ddp.checkpoint")

PROBE_PREFIX = ".shared-storage-probe-"
# torchrun's per-node rank: the rank with LOCAL_RANK 0 reads the probe for its node.
ENV_LOCAL_RANK = "LOCAL_RANK"


def check_shared_storage(storage: Storage, coll: Collectives, *, reader: bool | None = None) -> None:
    """Raise :class:`CheckpointError` on every rank unless every reader sees rank 0's probe.

    ``reader``: whether this rank reads the probe; default: ranks whose ``LOCAL_RANK`` is 0 (one per
    node), or every rank where ``LOCAL_RANK`` is unset. The error names ``storage.url`` and the ranks
    that could not read the probe, and says that ``checkpoint.url`` must be storage shared by all nodes.
    """
    if reader is None:
        reader = os.environ.get(ENV_LOCAL_RANK, "0") == "0"

    def write_probe() -> str:
        token = secrets.token_hex(16)
        storage.makedirs(storage.url)
        storage.write_bytes_atomic(join(storage.url, f"{PROBE_PREFIX}{token}"), token.encode())
        return token

    written = coll.attempt(write_probe)
    if written.error is not None:
        raise CheckpointError(f"Rank 0 could not write a probe file under checkpoint.url {storage.url!r}: {written.error}")
    token = written.value
    probe = join(storage.url, f"{PROBE_PREFIX}{token}")
    problem = None
    if reader:
        try:
            if storage.read_bytes(probe) != token.encode():
                problem = "it holds another token"
        except FileNotFoundError:
            problem = "it does not exist there"
        except StorageError as exc:
            problem = f"reading it failed: {exc}"
    failures = coll.gather((coll.rank, problem))

    def verdict() -> str | None:
        try:
            storage.remove_file(probe)
        except StorageError as exc:  # a leftover probe is harmless; the verdict is what matters
            log.warning("[0/-] Could not remove the storage probe %s: %s", probe, exc)
        bad = [(rank, why) for rank, why in failures if why]
        if not bad:
            return None
        return (
            f"checkpoint.url must be storage shared by all nodes, but rank(s) {', '.join(str(r) for r, _ in bad)} "
            f"could not read the probe file rank 0 wrote under {storage.url!r} ({bad[0][1]}), so that URL is not "
            "storage shared by all nodes. A local path is "
            "local to each machine: use a shared filesystem mounted at the same path on every node, or an "
            "object store (s3://bucket/prefix)."
        )

    message = coll.broadcast(verdict)
    if message:
        log.error("[%d/-] %s", coll.rank, message)
        raise CheckpointError(message)
