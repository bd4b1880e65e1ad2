"""What is committed under a checkpoint URL: manifests read, listed and checked (no process group).

A checkpoint is a ``step-NNNNNNNNN`` directory with a parseable ``manifest.json``. This module reads
manifests, lists checkpoints, checks files against a manifest, reads a checkpoint's ``index.json``
and decides retention; the manager and the CLI build on it.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

from elastic_ddp.checkpoint import index as ix
from elastic_ddp.checkpoint import manifest as mf
from elastic_ddp.checkpoint.errors import CheckpointError, CheckpointVerificationError
from elastic_ddp.checkpoint.storage import Storage, StorageError, join

log = logging.getLogger("elastic_ddp.checkpoint")

STEP_DIR_RE = re.compile(r"^step-(\d{9,})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:09d}"


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint as its manifest describes it."""

    step: int
    url: str
    world_size: int
    bytes: int
    time: float
    identity_digest: str
    identity: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    manifest: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_manifest(cls, url: str, manifest: dict[str, Any]) -> CheckpointInfo:
        return cls(
            step=manifest["step"],
            url=url,
            world_size=manifest["world_size"],
            bytes=int(manifest.get("bytes", 0)),
            time=float(manifest.get("time", 0.0)),
            identity_digest=manifest["identity_digest"],
            identity=dict(manifest["identity"]),
            manifest=manifest,
        )

    @property
    def key(self) -> tuple[str, str]:
        """This checkpoint's URL and the hash of its manifest (what a verification vouches for)."""
        return self.url, mf.hash_bytes(mf.canonical_json(self.manifest))

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "url": self.url,
            "world_size": self.world_size,
            "bytes": self.bytes,
            "time": self.time,
            "identity_digest": self.identity_digest,
            "identity": self.identity,
            "versions": self.manifest.get("versions", {}),
            "signed": "signature" in self.manifest,
            "rdzv_round": self.manifest.get("rdzv_round"),
        }


def read_checkpoint(storage: Storage, ckpt_url: str) -> CheckpointInfo:
    """The checkpoint at ``ckpt_url`` from its manifest. Raises CheckpointError if it has none or a bad one."""
    where = f"{ckpt_url}/{mf.MANIFEST_NAME}"
    try:
        data = storage.read_bytes(join(ckpt_url, mf.MANIFEST_NAME))
    except FileNotFoundError:
        raise CheckpointError(
            f"{ckpt_url!r} is not a committed checkpoint: it has no {mf.MANIFEST_NAME}."
        ) from None
    try:
        manifest = mf.parse(data, where)
    except mf.ManifestError as exc:
        raise CheckpointError(str(exc)) from None
    return CheckpointInfo.from_manifest(ckpt_url, manifest)


def list_checkpoints(storage: Storage, root_url: str | None = None) -> list[CheckpointInfo]:
    """Committed checkpoints under ``root_url`` (default ``storage.url``; a caller holding a storage for
    the URL's filesystem passes it instead of building another), oldest first. Unreadable manifests
    are skipped with a warning."""
    root = storage.url if root_url is None else root_url
    out = []
    for name in storage.list_dirs(root):
        if not STEP_DIR_RE.match(name):
            continue
        ckpt_url = join(root, name)
        if not storage.exists(join(ckpt_url, mf.MANIFEST_NAME)):
            continue  # an interrupted or in-progress save: never a checkpoint
        try:
            out.append(read_checkpoint(storage, ckpt_url))
        except CheckpointError as exc:
            log.warning("Skipping %s: %s", ckpt_url, exc)
    return sorted(out, key=lambda info: info.step)


def verify_checkpoint(storage: Storage, info: CheckpointInfo, names: list[str] | None = None) -> mf.VerifyResult:
    """Signature (when a key is set) and then files ``names`` (default all) against the manifest."""
    try:
        mf.check_signature(info.manifest, mf.signing_key(), f"{info.url}/{mf.MANIFEST_NAME}")
    except mf.ManifestError as exc:
        return mf.VerifyResult(False, mf.MANIFEST_NAME, str(exc))
    if ix.INDEX_NAME not in info.manifest["files"]:
        return mf.VerifyResult(False, ix.INDEX_NAME, "the manifest does not list it")
    try:
        return mf.verify_files(storage, info.url, info.manifest, names)
    except StorageError as exc:
        return mf.VerifyResult(False, "", f"reading failed: {exc}")


def read_index(storage: Storage, info: CheckpointInfo) -> ix.Index:
    """``index.json`` of ``info``, its bytes checked against the (signature-checked) manifest.

    Raises :class:`CheckpointVerificationError` naming what does not match.
    """
    try:
        mf.check_signature(info.manifest, mf.signing_key(), f"{info.url}/{mf.MANIFEST_NAME}")
    except mf.ManifestError as exc:
        raise CheckpointVerificationError(str(exc), mf.MANIFEST_NAME, str(exc)) from None
    files = mf.file_records(info.manifest)
    record = files.get(ix.INDEX_NAME)
    if record is None:
        raise CheckpointVerificationError(
            f"The manifest of {info.url!r} does not list {ix.INDEX_NAME}.", ix.INDEX_NAME, "the manifest does not list it"
        )
    try:
        data = storage.read_bytes(join(info.url, ix.INDEX_NAME))
    except FileNotFoundError:
        raise CheckpointVerificationError(
            f"{info.url!r} has no {ix.INDEX_NAME}.", ix.INDEX_NAME, "the file is missing"
        ) from None
    except StorageError as exc:
        raise CheckpointVerificationError(str(exc), ix.INDEX_NAME, f"reading failed: {exc}") from exc
    if len(data) != record.size or mf.hash_bytes(data, record.algorithm) != record.digest:
        reason = f"its size or {record.algorithm.upper()} checksum does not match the manifest"
        raise CheckpointVerificationError(f"{ix.INDEX_NAME} of {info.url!r}: {reason}.", ix.INDEX_NAME, reason)
    try:
        index = ix.parse(data, f"{info.url}/{ix.INDEX_NAME}")
    except ix.IndexFormatError as exc:
        raise CheckpointVerificationError(str(exc), ix.INDEX_NAME, str(exc)) from None
    listed = {f.name: f.size for f in index.files}
    in_manifest = {name: rec.size for name, rec in files.items() if name != ix.INDEX_NAME}
    if listed != in_manifest or any(f.writer >= info.world_size for f in index.files):
        reason = "the files it lists are not the manifest's"
        raise CheckpointVerificationError(f"{ix.INDEX_NAME} of {info.url!r}: {reason}.", ix.INDEX_NAME, reason)
    return index


def retention_plan(
    steps: list[int], *, keep_last: int, keep_every: int | None, protected: set[int]
) -> tuple[list[int], str]:
    """Which committed steps to delete, and why: a pure function, no I/O.

    Keeps the newest ``keep_last``, every multiple of ``keep_every`` and the ``protected`` steps.
    """
    ordered = sorted(steps)
    keep = set(ordered[-keep_last:]) | protected
    if keep_every:
        keep |= {s for s in ordered if s % keep_every == 0}
    delete = [s for s in ordered if s not in keep]
    why = f"keep_last={keep_last}, keep_every={keep_every}, protected={sorted(protected)}: deleting {delete}"
    return delete, why
