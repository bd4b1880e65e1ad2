"""Checkpoint trust under the recipe: bucket write access without the signing key is not code execution.

A job signs its checkpoints with ``ELASTIC_DDP_CHECKPOINT_KEY`` on a real S3 API (moto). An
attacker who can write the bucket but does not hold the key then replaces the newest
checkpoint's ``index.json`` (the first file a resume parses) with a pickle that creates a marker
file when unpickled, and rewrites the manifest's size and SHA-256 for it so that the checksums
match again; the signature, which they cannot recompute, stays as it was. Restarted under
torchrun, the job must skip that checkpoint with a warning naming it, resume from the one before,
and never run the payload, which the test finally shows to be live.
"""

from __future__ import annotations

import json
import os
import pickle
import secrets

import fsspec
import pytest

from elastic_ddp.checkpoint import ENV_CHECKPOINT_KEY
from elastic_ddp.checkpoint import manifest as mf
from tests.helpers.job import Job, resumed_steps, steps


class Evil:
    """Unpickling this creates the marker file: proof that a planted pickle ran (or did not)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant_index(fs, ckpt: str, marker: str) -> bytes:
    """Replace ``ckpt``'s ``index.json`` with a code-running pickle and fix the manifest's checksums."""
    payload = pickle.dumps(Evil(marker))
    with fs.open(f"{ckpt}/index.json", "wb") as file:
        file.write(payload)
    manifest = json.loads(fs.cat_file(f"{ckpt}/manifest.json"))
    manifest["files"]["index.json"] = mf.FileRecord("index.json", len(payload), mf.hash_bytes(payload)).to_json()
    manifest["bytes"] = sum(rec["size"] for rec in manifest["files"].values())
    with fs.open(f"{ckpt}/manifest.json", "wb") as file:
        file.write(json.dumps(manifest).encode())
    return payload


@pytest.mark.slow
def test_a_re_checksummed_checkpoint_with_a_planted_pickle_is_skipped_and_never_unpickled(
    etcd_endpoint, s3_url, tmp_path
):
    marker = tmp_path / "pwned"
    key = {ENV_CHECKPOINT_KEY: f"trust-{secrets.token_hex(16)}"}
    common = [f"--checkpoint.url={s3_url}", "--checkpoint.every_steps=2", "--checkpoint.async_save=false"]

    first = Job(etcd_endpoint, tmp_path / "first", nnodes="1", flags=[*common, "--train.max_steps=4"], extra_env=key)
    try:
        code = first.add_node().wait(timeout=180)
    finally:
        first.cleanup()
    assert code == 0, first.output()[-6000:]

    fs = fsspec.filesystem("s3")
    bucket_path = s3_url.removeprefix("s3://")
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(bucket_path, refresh=True))
    assert [n for n in names if n.startswith("step-")] == ["step-000000002", "step-000000004"], names
    tampered = f"{s3_url}/step-000000004"
    signature = json.loads(fs.cat_file(f"{bucket_path}/step-000000004/manifest.json"))["signature"]
    payload = _plant_index(fs, f"{bucket_path}/step-000000004", str(marker))
    manifest = json.loads(fs.cat_file(f"{bucket_path}/step-000000004/manifest.json"))
    assert manifest["signature"] == signature  # kept: the attacker cannot sign

    # Ends at step 3, so the resumed run saves no step-4 checkpoint of its own.
    second = Job(etcd_endpoint, tmp_path / "second", nnodes="1", flags=[*common, "--train.max_steps=3"], extra_env=key)
    try:
        code = second.add_node().wait(timeout=180)
    finally:
        second.cleanup()
    output = second.output()
    assert code == 0, output[-6000:]
    assert f"Skipping checkpoint {tampered}" in output and "does not match ELASTIC_DDP_CHECKPOINT_KEY" in output, output[-6000:]
    assert f"Resumed from {s3_url}/step-000000002 (step 2)" in output, output[-6000:]
    assert resumed_steps(output) == [2] and max(s for s, _ in steps(output)) == 3, output[-6000:]
    assert not marker.exists(), "the planted pickle was unpickled"

    # The payload is live: unpickling what the attacker planted really runs code.
    assert fs.cat_file(f"{bucket_path}/step-000000004/index.json") == payload
    pickle.loads(payload)
    assert marker.exists()
    os.remove(marker)
