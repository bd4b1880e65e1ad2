"""No secret leaks: a real job with known secrets, then a search of everything it wrote.

The job is two torchrun agents running the recipe, joined through an etcd with mutual TLS and
auth on (a user whose password exists only in ``ELASTIC_DDP_ETCD_PASSWORD``), checkpointing to a
real S3 API (moto) with bucket credentials in the standard AWS variables *and* in
``checkpoint.storage_options`` (from a config file), and signing its manifests with
``ELASTIC_DDP_CHECKPOINT_KEY``. One worker fails once on purpose, so the job also writes a
failure record, torchrun's error file and a resume.

Then every byte the job produced is searched for every secret: both agents' output, every file
under the job's root (TensorBoard event files raw *and* decoded, the ledger, ``failures.jsonl``,
``progress.json``, torchrun's per-worker logs and error files), every object under the
checkpoint prefix (manifests, ``index.json``, shards), and every etcd key and value under the
run's prefix. A secret counts as found raw, base64 (standard or URL-safe, at any byte
alignment), percent-encoded or hex. The test first shows that the search finds planted secrets,
and checks that it looked at the files that would hold a leak, so it cannot pass by looking at
nothing.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import secrets
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from elastic_ddp.checkpoint import ENV_CHECKPOINT_KEY
from elastic_ddp.rendezvous import plugin
from elastic_ddp.etcd import EtcdClient
from tests.fixtures.s3 import BUCKET
from tests.helpers.job import Job, resumed_steps, steps
from tests.integration.test_security_etcd import JOB_PREFIX, ROOT_PASSWORD, _etcdctl, pki, secure_etcd  # noqa: F401 (fixtures)

LEAK_USER = "job-leak"
ROLE = "job-secure"  # read-write on JOB_PREFIX only (tests/integration/test_security_etcd.py)
MAX_STEPS = 8


def _secrets() -> dict[str, str]:
    """Fresh, unguessable values: none can occur in the job's output by chance."""
    token = secrets.token_hex
    return {
        "etcd password": f"etcd-pw-{token(12)}",
        "AWS_ACCESS_KEY_ID": f"AKIA{token(8).upper()}",
        # Real secret keys contain '/' and '+', which percent-encoding and base64 treat specially.
        "AWS_SECRET_ACCESS_KEY": f"{token(10)}/{token(6)}+{token(6)}",
        "AWS_SESSION_TOKEN": f"session-{token(16)}",
        ENV_CHECKPOINT_KEY: f"hmac/{token(16)}+key",
    }


def _base64_forms(secret: bytes) -> set[bytes]:
    """The part of the base64 text of ``secret`` that does not depend on its neighbours, for each
    of the three byte alignments it may have inside a larger encoded blob."""
    forms = set()
    for pad in range(3):
        encoded = base64.b64encode(b"\0" * pad + secret)
        # Character i encodes bits [6i, 6i+6): keep those lying wholly inside the secret's bits.
        stable = encoded[-(-8 * pad // 6) : 8 * (pad + len(secret)) // 6]
        forms |= {stable, stable.replace(b"+", b"-").replace(b"/", b"_")}
    return forms


def encoded_forms(secret: str) -> dict[bytes, str]:
    """Every encoding of ``secret`` searched for, mapped to the encoding's name."""
    raw = secret.encode()
    forms = {raw: "raw"}
    for quoted in (urllib.parse.quote(secret), urllib.parse.quote(secret, safe=""), urllib.parse.quote_plus(secret)):
        forms[quoted.encode()] = "percent-encoded"
    forms[binascii.hexlify(raw)] = "hex"
    forms |= {form: "base64" for form in _base64_forms(raw)}
    return forms


@dataclass
class SecretSearch:
    """Searches blobs for every form of every secret; remembers what it looked at and found."""

    secrets: dict[str, str]

    def __post_init__(self) -> None:
        self.forms = {name: encoded_forms(value) for name, value in self.secrets.items()}
        self.searched: list[str] = []
        self.found: list[str] = []

    def hits(self, blob: bytes) -> list[str]:
        return [
            f"{name} ({how})"
            for name, forms in self.forms.items()
            for form, how in forms.items()
            if form in blob
        ]

    def search(self, where: str, blob: bytes) -> None:
        self.searched.append(where)
        self.found.extend(f"{hit} in {where}" for hit in self.hits(blob))


def _event_texts(event_file: Path) -> tuple[list[str], list[str]]:
    """(tags, decoded text values) of one TensorBoard event file, as TensorBoard reads them."""
    acc = EventAccumulator(str(event_file), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    tags = [tag for kind in ("scalars", "tensors") for tag in acc.Tags()[kind]]
    texts = []
    for tag in acc.Tags()["tensors"]:
        for event in acc.Tensors(tag):
            for value in tensor_util.make_ndarray(event.tensor_proto).flatten():
                texts.append(value.decode() if isinstance(value, bytes) else str(value))
    return tags, texts


def _bucket_objects(prefix_url: str) -> dict[str, bytes]:
    """Every object under ``s3://BUCKET/<prefix>`` (the test's own client, the fixture's keys)."""
    prefix = prefix_url.removeprefix(f"s3://{BUCKET}/")
    client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    objects = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        for item in page.get("Contents", []):
            objects[item["Key"]] = client.get_object(Bucket=BUCKET, Key=item["Key"])["Body"].read()
    return objects


@pytest.fixture(scope="module")
def leak_user(secure_etcd, pki) -> tuple[str, str]:  # noqa: F811 (pytest fixtures by name)
    """An etcd user of this module's own, with a fresh password, limited to JOB_PREFIX."""
    password = f"etcd-pw-{secrets.token_hex(12)}"
    root = f"--user=root:{ROOT_PASSWORD}"
    # The password goes in on stdin, as an operator would type it: not in any process listing.
    _etcdctl(secure_etcd, pki, root, "user", "add", LEAK_USER, "--interactive=false", stdin=f"{password}\n")
    _etcdctl(secure_etcd, pki, root, "user", "grant-role", LEAK_USER, ROLE)
    return LEAK_USER, password


def test_the_search_finds_each_encoding_at_any_alignment() -> None:
    search = SecretSearch({"key": "hmac/0123456789abcdef+key"})
    secret = b"hmac/0123456789abcdef+key"
    for prefix in (b"", b"x", b"xy"):
        assert search.hits(base64.b64encode(prefix + secret + b"tail")) == ["key (base64)"]
        assert search.hits(base64.urlsafe_b64encode(prefix + secret)) == ["key (base64)"]
    assert search.hits(b"s3://b/k?secret=" + urllib.parse.quote(secret).encode()) == ["key (percent-encoded)"]
    assert search.hits(b'{"k": "' + secret + b'"}') == ["key (raw)"]
    assert search.hits(binascii.hexlify(b"--" + secret)) == ["key (hex)"]
    assert search.hits(b"hmac/0123456789abcdef+kez") == []


@pytest.mark.slow
def test_a_job_with_known_secrets_writes_none_of_them_anywhere(secure_etcd, pki, leak_user, s3_url, tmp_path):  # noqa: F811
    user, etcd_password = leak_user
    values = _secrets() | {"etcd password": etcd_password}
    access_key, secret_key, session = (values[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"))
    # The same bucket credentials reach s3fs through checkpoint.storage_options too, so the saved
    # config would show them if redaction failed. The file is the job's input, kept apart from
    # what the job writes.
    config_file = tmp_path / "input" / "job.yaml"
    config_file.parent.mkdir()
    config_file.write_text(
        yaml.safe_dump({"checkpoint": {"storage_options": {"key": access_key, "secret": secret_key, "token": session}}})
    )
    search = SecretSearch(values)
    assert search.hits(config_file.read_bytes()), "the search must find the secrets in the job's input"

    root = tmp_path / "job"
    run_id = f"leak-{secrets.token_hex(4)}"
    rdzv_conf = {
        "protocol": "https", "cacert": pki.ca, "cert": pki.client_cert, "key": pki.client_key,
        "user": user, "etcd_prefix": JOB_PREFIX,
    }  # fmt: skip
    job = Job(
        secure_etcd.endpoint,
        root,
        nnodes="2",
        run_id=run_id,
        flags=[
            f"--config={config_file}", f"--checkpoint.url={s3_url}", "--checkpoint.every_steps=2",
            f"--train.max_steps={MAX_STEPS}", "--data.ledger=true",
        ],
        extra_env={
            plugin.PASSWORD_ENV: etcd_password, ENV_CHECKPOINT_KEY: values[ENV_CHECKPOINT_KEY],
            "AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key, "AWS_SESSION_TOKEN": session,
            # Everything elastic_ddp logs, at its most verbose.
            "ELASTIC_DDP_LOG_LEVEL": "DEBUG",
            # One failure: a failure record, torchrun's error file, a restart and a resume.
            "ELASTIC_DDP_FAULT": "raise@5:rank=1:restart=0",
        },
        torchrun_flags=[
            "--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in rdzv_conf.items()),
            f"--log-dir={root / 'torchrun'}", "--redirects=3", "--tee=3",
        ],
    )  # fmt: skip
    try:
        for _ in range(2):
            job.add_node()
        codes = [node.wait(timeout=240) for node in job.nodes]
    finally:
        job.cleanup()
    output = job.output()
    assert codes == [0, 0], output[-6000:]
    assert max(s for s, _ in steps(output)) == MAX_STEPS, output[-6000:]
    # The step-4 save is asynchronous: the failure at step 5 may come before it commits.
    resumed = resumed_steps(output)
    assert len(resumed) == 1 and resumed[0] in (2, 4), output[-6000:]

    # 1. Everything under the job's root: the agents' logs, the run directory, torchrun's files.
    files = sorted(p for p in root.rglob("*") if p.is_file())
    for path in files:
        search.search(str(path.relative_to(root)), path.read_bytes())
    names = {p.name for p in files}
    run_dir = root / run_id
    assert {f"{run_id}-node0.log", f"{run_id}-node1.log", "failures.jsonl", "progress.json"} <= names, sorted(names)
    assert any(p.name == "error.json" for p in files), "torchrun wrote no error file for the injected failure"
    assert list((run_dir / "ledger").iterdir()), "no ledger was written"
    event_files = sorted((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(event_files) >= 2, event_files  # one per attempt

    # 2. TensorBoard as TensorBoard decodes it: tag names and every text value.
    configs = []
    for path in event_files:
        tags, texts = _event_texts(path)
        search.search(f"{path.name} (decoded)", "\n".join(tags + texts).encode())
        configs += [text for text in texts if "storage_options" in text]
    assert configs, "no configuration text was found in TensorBoard"
    saved = yaml.safe_load(configs[0].strip().removeprefix("```yaml").removesuffix("```"))  # a fenced block
    assert saved["checkpoint"]["storage_options"] == {"key": "<redacted>", "secret": "<redacted>", "token": "<redacted>"}

    # 3. Every object of the checkpoints.
    objects = _bucket_objects(s3_url)
    for key, blob in objects.items():
        search.search(f"s3://{BUCKET}/{key}", blob)
    kinds = {key.rsplit("/", 1)[-1] for key in objects}
    shards = [k for k in kinds if re.fullmatch(r"shard-\d{5}-\d{2}\.bin", k)]
    assert {"manifest.json", "index.json"} <= kinds and shards, sorted(kinds)
    manifests = [json.loads(blob) for key, blob in objects.items() if key.endswith("/manifest.json")]
    assert len(manifests) >= 2 and all(m["signature"]["algorithm"] == "hmac-sha256" for m in manifests)

    # 4. What the job left in etcd under its prefix: keys and values, and the backend's decoded state.
    client = EtcdClient(
        secure_etcd.endpoint, ca_cert=pki.ca, cert=pki.client_cert, key=pki.client_key,
        user=user, password=etcd_password,
    )  # fmt: skip
    try:
        kvs = client.get_prefix(f"{JOB_PREFIX}/{run_id}/")
    finally:
        client.close()
    assert kvs, "the job left nothing in etcd"
    for kv in kvs:
        search.search(f"etcd {kv.key!r}", kv.key + b"\n" + kv.value)
        try:
            search.search(f"etcd {kv.key!r} (base64-decoded)", base64.b64decode(kv.value, validate=True))
        except binascii.Error:
            pass  # not base64: searched raw above

    print(f"searched {len(search.searched)} blobs: {len(files)} files, {len(event_files)} event files decoded, "
          f"{len(objects)} objects, {len(kvs)} etcd keys:\n  " + "\n  ".join(search.searched))  # fmt: skip
    assert not search.found, "secrets leaked:\n" + "\n".join(search.found)
