"""The manifest: a checkpoint's commit point, its file checksums and its optional signature.

A step directory is a checkpoint only once ``manifest.json`` exists in it. The manifest is written
last, by rank 0, after every rank's files are durable; it lists every file of the checkpoint with
its size and SHA-256. Readers check each file against it as they read it; the format itself holds
no pickles (``index.json`` is JSON, data files are raw tensor bytes), so even a file that slipped
past the checks could not execute code.

Signing: when :data:`ENV_CHECKPOINT_KEY` is set, the manifest carries an HMAC-SHA256 over its
canonical JSON (sorted keys, no whitespace, without the ``signature`` field). With a key set, an
unsigned or mis-signed manifest is refused. The key itself is never written anywhere.

SHA-256 was chosen over BLAKE2b because this machine's CPU hashes it ~2x faster (SHA extensions);
see docs/checkpoints.md for the measured cost.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass
from typing import Any

from elastic_ddp.checkpoint.storage import Storage, join

# The secret that signs manifests. Read at save and at load; never logged or stored.
ENV_CHECKPOINT_KEY = "ELASTIC_DDP_CHECKPOINT_KEY"

MANIFEST_NAME = "manifest.json"
# 3: raw tensor files + index.json (no pickles); 2 was DCP's shards and its pickled .metadata.
FORMAT_VERSION = 3
CHECKSUM_ALGORITHM = "sha256"
_CHUNK = 8 << 20


class ManifestError(ValueError):
    """A manifest is malformed, unsigned where a signature is required, or its signature is wrong."""


@dataclass(frozen=True)
class FileRecord:
    """One file of a checkpoint as the manifest records it."""

    name: str
    size: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "sha256": self.sha256}


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of checking a checkpoint's files against its manifest: ``ok``, or which file failed and why."""

    ok: bool
    bad_file: str = ""
    reason: str = ""


def new_hasher() -> Any:
    return hashlib.new(CHECKSUM_ALGORITHM)


def hash_stream(stream: Any) -> tuple[int, str]:
    """Size and hex digest of everything readable from ``stream``."""
    hasher = new_hasher()
    size = 0
    while chunk := stream.read(_CHUNK):
        hasher.update(chunk)
        size += len(chunk)
    return size, hasher.hexdigest()


def identity_digest(identity: dict[str, Any]) -> str:
    """First 16 hex digits of the SHA-256 of ``identity`` as canonical JSON."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def hash_bytes(data: bytes) -> str:
    return hashlib.new(CHECKSUM_ALGORITHM, data).hexdigest()


def signing_key() -> bytes | None:
    """The signing key from :data:`ENV_CHECKPOINT_KEY`, or None when it is unset or empty."""
    value = os.environ.get(ENV_CHECKPOINT_KEY, "")
    return value.encode() if value else None


def canonical_json(manifest: dict[str, Any]) -> bytes:
    """The bytes the signature covers: the manifest without ``signature``, keys sorted, no spaces."""
    body = {k: v for k, v in manifest.items() if k != "signature"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def sign(manifest: dict[str, Any], key: bytes) -> dict[str, Any]:
    """Return a copy of ``manifest`` with its HMAC-SHA256 ``signature``."""
    signed = dict(manifest)
    signed["signature"] = {
        "algorithm": "hmac-sha256",
        "value": hmac.new(key, canonical_json(manifest), hashlib.sha256).hexdigest(),
    }
    return signed


def check_signature(manifest: dict[str, Any], key: bytes | None, where: str) -> None:
    """Raise :class:`ManifestError` if ``key`` is set and ``manifest`` is unsigned or mis-signed."""
    if key is None:
        return
    sig = manifest.get("signature")
    if not isinstance(sig, dict) or sig.get("algorithm") != "hmac-sha256" or not isinstance(sig.get("value"), str):
        raise ManifestError(
            f"The manifest {where} is not signed, but {ENV_CHECKPOINT_KEY} is set; refusing to load it."
        )
    expected = hmac.new(key, canonical_json(manifest), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, sig["value"]):
        raise ManifestError(
            f"The manifest {where} has a signature that does not match {ENV_CHECKPOINT_KEY}; "
            "it was changed or signed with another key. Refusing to load it."
        )


def build(
    *,
    step: int,
    world_size: int,
    time_s: float,
    versions: dict[str, str],
    identity: dict[str, Any],
    files: list[FileRecord],
    rdzv_round: int | None = None,
) -> dict[str, Any]:
    """The manifest dict for a checkpoint (signed when a key is set). ``files`` must be every file.

    ``identity``: the run's identity (JSON values of the settings a resume must not change), stored
    whole and as :func:`identity_digest`, so a refused resume can name the fields that differ.

    ``rdzv_round``: the rendezvous round of the group that committed it (None outside one), for
    the record: which group wrote what is then visible in ``elastic-ddp ckpt list --json``.
    """
    manifest = {
        "format": FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "time": time_s,
        "versions": versions,
        "identity_digest": identity_digest(identity),
        "identity": identity,
        "checksum": CHECKSUM_ALGORITHM,
        "bytes": sum(f.size for f in files),
        "files": {f.name: f.to_json() for f in sorted(files, key=lambda f: f.name)},
    }
    if rdzv_round is not None:
        manifest["rdzv_round"] = rdzv_round
    key = signing_key()
    return sign(manifest, key) if key is not None else manifest


def parse(data: bytes, where: str) -> dict[str, Any]:
    """Parse and shape-check manifest bytes (JSON only: nothing is unpickled). Raises ManifestError."""
    try:
        manifest = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"The manifest {where} is not valid JSON: {exc}.") from None
    if not isinstance(manifest, dict):
        raise ManifestError(f"The manifest {where} must be a JSON object, not {type(manifest).__name__}.")
    if manifest.get("format") != FORMAT_VERSION:
        raise ManifestError(
            f"The manifest {where} has format {manifest.get('format')!r}; this version reads format {FORMAT_VERSION}. "
            "Load it with the elastic_ddp version named in its 'versions' field, or start a new run."
        )
    for field, kind in (
        ("step", int), ("world_size", int), ("files", dict), ("identity_digest", str), ("identity", dict),
    ):  # fmt: skip
        if not isinstance(manifest.get(field), kind):
            raise ManifestError(f"The manifest {where} lacks a valid {field!r} field.")
    for name, rec in manifest["files"].items():
        if (
            "/" in name
            or name in ("", ".", "..")
            or not isinstance(rec, dict)
            or not isinstance(rec.get("size"), int)
            or not isinstance(rec.get("sha256"), str)
        ):
            raise ManifestError(f"The manifest {where} has an invalid entry for file {name!r}.")
    return manifest


def verify_files(storage: Storage, ckpt_url: str, manifest: dict[str, Any], names: list[str] | None = None) -> VerifyResult:
    """Check the files ``names`` (default: all) of the checkpoint at ``ckpt_url`` against ``manifest``.

    Sizes are checked first (one listing, cheap), then checksums (a full read). Files present in the
    directory but absent from the manifest are ignored: they were never part of the commit.
    """
    files: dict[str, dict[str, Any]] = manifest["files"]
    wanted = sorted(files) if names is None else names
    present = storage.list_files(ckpt_url)
    for name in wanted:
        expected = files[name]["size"]
        if name not in present:
            return VerifyResult(False, name, "the file is missing")
        if present[name] != expected:
            return VerifyResult(False, name, f"its size is {present[name]} bytes, the manifest says {expected}")
    for name in wanted:
        with storage.open_read(join(ckpt_url, name)) as stream:
            size, digest = hash_stream(stream)
        if size != files[name]["size"]:
            return VerifyResult(False, name, f"{size} bytes were read, the manifest says {files[name]['size']}")
        if not hmac.compare_digest(digest, files[name]["sha256"]):
            return VerifyResult(False, name, "its SHA-256 does not match the manifest")
    return VerifyResult(True)
