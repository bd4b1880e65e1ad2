"""What ``torch.compile`` built, carried beside the checkpoints to nodes that have not built it.

A compiled model's first step compiles: tracing, AOTAutograd, inductor's code generation, and on
GPUs Triton's kernels and their autotuning (minutes for a large model). A restart on the same node
finds most of that in torch's node-local caches (``TORCHINDUCTOR_CACHE_DIR``, /tmp by default: they
outlive the workers). A node that joins a running job, or replaces a lost one, has none of it, and
every rank waits at the first step's collective while it compiles cold.

torch's own answer is its portable cache ("mega-cache"): ``torch.compiler.save_cache_artifacts()``
serializes the inductor (FX graph, with Triton kernels bundled on GPUs), AOTAutograd, autotuning and
profile-guided artifacts a process produced or used; ``load_cache_artifacts()`` writes them into
another node's caches. So rank 0 publishes them after its first compiled step of each attempt, as
``{checkpoint.url}/compile/<tag>.bin`` with a record ``<tag>.json`` (size, BLAKE3, torch version,
signature); ``<tag>`` names the torch version and device kind, since the artifacts of another one
cannot hit. At its start each node loads them into its cache once -- the first local rank that finds
them new, under a file lock in the cache directory, the others then find a mark -- before any rank
compiles. A restart reads nothing: the mark is there.

**Trust.** Unlike a checkpoint (tensors only, no pickles), the artifacts hold code: pickles and
generated source that the loading process runs. Whoever can write them can run code on every node
that loads them. They are therefore shared only when the record is signed with the checkpoint key
(``ELASTIC_DDP_CHECKPOINT_KEY``, HMAC-SHA256 as a manifest is), or when the user says the storage's
writers are trusted (``checkpoint.share_compiled=on``). A record that fails its check is refused in
one line and the node compiles as if there were none; a bad file never fails the run.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import time
from contextlib import contextmanager
from typing import Iterator, Literal

import blake3
import torch

from elastic_ddp.checkpoint.manifest import ENV_CHECKPOINT_KEY, ManifestError, check_signature, sign
from elastic_ddp.checkpoint.storage import Storage, StorageError

__all__ = ["CompiledArtifacts", "artifacts_tag"]

log = logging.getLogger(__name__)

DIR = "compile"
FORMAT = "elastic_ddp.compile/1"


def artifacts_tag(device: torch.device) -> str:
    """The name of the artifacts a process on ``device`` can use: torch's version and the device kind
    (a CUDA device's name and compute capability; artifacts of another one cannot hit)."""
    kind = "cpu"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        kind = f"{torch.cuda.get_device_name(device)}-sm{major}{minor}"
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", f"torch-{torch.__version__}-{kind}")


class CompiledArtifacts:
    """One rank's side of the compile artifacts of a run (see the module docstring).

    ``share``: ``"auto"`` (shared when the checkpoint key is set), ``"on"`` (shared unsigned too: the
    storage's writers are trusted to run code), ``"off"``. ``key``: the checkpoint signing key or None.
    """

    def __init__(self, storage: Storage, *, share: Literal["auto", "on", "off"], key: bytes | None,
                 device: torch.device, rank: int) -> None:  # fmt: skip
        self.storage = storage
        self.key = key
        self.rank = rank
        self.enabled = share == "on" or (share == "auto" and key is not None)
        self.why_off = None if self.enabled else (
            "checkpoint.share_compiled=off" if share == "off" else
            f"they hold code, and without {ENV_CHECKPOINT_KEY} nothing proves who wrote them "
            "(checkpoint.share_compiled=on shares them unsigned)"
        )  # fmt: skip
        self.tag = artifacts_tag(device)
        self.url = f"{storage.url.rstrip('/')}/{DIR}/{self.tag}"
        self._published: str | None = None  # the BLAKE3 this process last found or wrote

    # ------------------------------------------------------------------------------------ load

    def load(self) -> str | None:
        """Load the run's artifacts into this node's compile caches unless the node has them already;
        a line saying what happened, or None when there was nothing to do. Never raises for what the
        storage holds: the model then compiles from scratch, as it would without this."""
        if not self.enabled:
            return None
        try:
            record = self._record()
        except (OSError, StorageError, ValueError, ManifestError) as exc:
            return f"torch.compile's artifacts at {self.url}.json are not used ({exc}); this node compiles from scratch."
        if record is None:
            return None
        self._published = record["blake3"]
        cache = _cache_dir()
        os.makedirs(cache, exist_ok=True)
        mark = os.path.join(cache, f"elastic_ddp-loaded-{record['blake3'][:32]}")
        with _locked(os.path.join(cache, "elastic_ddp-artifacts.lock")):
            if os.path.exists(mark):
                return None
            started = time.perf_counter()
            try:
                data = self.storage.read_bytes(f"{self.url}.bin")
                if len(data) != record["size"] or blake3.blake3(data).hexdigest() != record["blake3"]:
                    raise ValueError("its bytes do not match their record (size or BLAKE3)")
                torch.compiler.load_cache_artifacts(data)
            except (OSError, StorageError, ValueError) as exc:
                return f"torch.compile's artifacts at {self.url}.bin are not used ({exc}); this node compiles from scratch."
            with open(mark, "w", encoding="utf-8") as file:
                file.write(self.url)
        return (f"Loaded torch.compile's artifacts ({len(data) / 1e6:.1f} MB, {time.perf_counter() - started:.1f} s) "
                f"from {self.url}.bin into this node's caches ({cache}).")  # fmt: skip

    def _record(self) -> dict | None:
        url = f"{self.url}.json"
        if not self.storage.exists(url):
            return None
        record = json.loads(self.storage.read_bytes(url))
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            raise ValueError(f"not a record of format {FORMAT}")
        check_signature(record, self.key, url)
        if not isinstance(record.get("size"), int) or not isinstance(record.get("blake3"), str):
            raise ValueError("its size or BLAKE3 is missing")
        return record

    # --------------------------------------------------------------------------------- publish

    def publish(self) -> str | None:
        """Rank 0, after a compiled step: write what this process compiled or loaded, when it differs
        from what the storage holds; a line saying so, or None. A failed write is said and ignored
        (the artifacts only save time)."""
        if not self.enabled or self.rank != 0:
            return None
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return None
        data = saved[0]
        digest = blake3.blake3(data).hexdigest()
        if digest == self._published:
            return None
        record = {"format": FORMAT, "torch": torch.__version__, "size": len(data), "blake3": digest}
        if self.key is not None:
            record = sign(record, self.key)
        try:
            self.storage.makedirs(self.url.rsplit("/", 1)[0])
            self.storage.write_bytes_atomic(f"{self.url}.bin", data)
            self.storage.write_bytes_atomic(f"{self.url}.json", json.dumps(record, sort_keys=True).encode())
        except (OSError, StorageError) as exc:
            return f"torch.compile's artifacts could not be written to {self.url}.bin ({exc}); joining nodes compile from scratch."
        self._published = digest
        return f"Published torch.compile's artifacts ({len(data) / 1e6:.1f} MB) at {self.url}.bin for nodes that join."


def _cache_dir() -> str:
    """This node's inductor cache directory (``TORCHINDUCTOR_CACHE_DIR`` or torch's default under /tmp)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


@contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive lock between the node's local ranks (released when the process dies)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
