"""What torch.compile built on one node reaches a node that has not built it (checkpoint/compiled.py):
each "node" here is a process with an inductor cache directory of its own, sharing one storage."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.job import REPO

pytestmark = pytest.mark.slow

NODE = textwrap.dedent("""
    import json, sys
    import torch
    from torch import nn
    from torch._dynamo.utils import counters
    from elastic_ddp.checkpoint.compiled import CompiledArtifacts
    from elastic_ddp.checkpoint.storage import Storage

    storage_url, share, key, rank = sys.argv[1], sys.argv[2], sys.argv[3].encode() or None, int(sys.argv[4])
    artifacts = CompiledArtifacts(Storage(storage_url), share=share, key=key, device=torch.device("cpu"), rank=rank)
    loaded = artifacts.load()
    published = None
    if sys.argv[5] == "compile":
        torch.manual_seed(0)
        model = torch.compile(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2)))
        model(torch.randn(4, 8)).sum().backward()
        published = artifacts.publish()
    print(json.dumps({"loaded": loaded, "published": published, "why_off": artifacts.why_off,
                      "inductor": dict(counters["inductor"]), "aot": dict(counters["aot_autograd"])}))
""")


def node(tmp_path: Path, name: str, *, share: str = "auto", key: str = "k3y", rank: int = 1, compile: bool = True) -> dict:
    """One "node": a process with its own cache directory that loads the shared artifacts, then (``compile``)
    compiles the model and takes a step."""
    env = {"PYTHONPATH": str(REPO), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"cache-{name}"), "OMP_NUM_THREADS": "1",
           "PATH": "/usr/bin:/bin"}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", NODE, str(tmp_path / "ckpt"), share, key, str(rank),
                           "compile" if compile else "load"], env=env,
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_node_that_joins_loads_what_rank_0_compiled_and_compiles_nothing_cold(tmp_path):
    first = node(tmp_path, "a", rank=0)
    assert first["loaded"] is None and first["published"].startswith("Published torch.compile's artifacts")
    assert first["inductor"].get("fxgraph_cache_miss", 0) > 0  # compiled cold
    record = json.loads(next((tmp_path / "ckpt" / "compile").glob("*.json")).read_text())
    assert record["signature"]["algorithm"] == "hmac-sha256"

    joiner = node(tmp_path, "b")
    assert joiner["loaded"].startswith("Loaded torch.compile's artifacts"), joiner
    assert joiner["inductor"].get("fxgraph_cache_hit", 0) > 0 and not joiner["inductor"].get("fxgraph_cache_miss")
    assert joiner["aot"].get("autograd_cache_hit", 0) > 0 and not joiner["aot"].get("autograd_cache_miss")
    # A restart on that node: its caches have them; nothing is read again.
    again = node(tmp_path, "b")
    assert again["loaded"] is None and again["inductor"].get("fxgraph_cache_hit", 0) > 0


def test_artifacts_are_refused_unless_signed_with_the_key_or_trusted_by_name(tmp_path):
    node(tmp_path, "a", rank=0)
    # Refused, said in one line; the node then compiles from scratch and the run goes on.
    forged = node(tmp_path, "c", key="another key", compile=False)
    assert "are not used" in forged["loaded"] and "signature" in forged["loaded"], forged

    unsigned = node(tmp_path, "d", key="", compile=False)
    assert unsigned["loaded"] is None and "ELASTIC_DDP_CHECKPOINT_KEY" in unsigned["why_off"]
    trusted = node(tmp_path, "e", key="", share="on", compile=False)  # signed records load without the key too
    assert trusted["loaded"].startswith("Loaded"), trusted
    blob = next((tmp_path / "ckpt" / "compile").glob("*.bin"))
    blob.write_bytes(blob.read_bytes()[:-1] + b"x")
    changed = node(tmp_path, "f", compile=False)
    assert "do not match their record" in changed["loaded"], changed
