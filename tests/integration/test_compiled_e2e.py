"""A compiled model keeps the guarantees of an eager one: the user's ``torch.compile(model)`` handed to
``run.setup`` trains under DDP, resumes bitwise after a lost worker, and shares checkpoints with eager runs.

The script is tests/workers/ordinary_model.py (BatchNorm, dropout, an EMA of weights and buffers, a
per-rank counter) with ``--train.compile=true``, under real torchrun (CPU, gloo) at 3 ranks. Compiling
is slow on a small machine (tens of seconds for the first step with a cold cache), so the runs are
short and share one inductor cache, node-local under the module's temporary directory, as a node's
workers would across restarts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elastic_ddp.tools import checkpoint as ckpt_cli
from elastic_ddp.data import read_ledger
from tests.helpers.job import RECIPE, REPO, TINY, Job, env
from tests.integration.test_ordinary_model_e2e import assert_same_state, final_state

pytestmark = pytest.mark.slow

SCRIPT = REPO / "tests" / "workers" / "ordinary_model.py"
STEPS = 12
RANKS = 3


def run(root: Path, name: str, *flags: str, fault: str = "", restarts: int = 0, ranks: int = RANKS,
        script: Path = SCRIPT) -> str:  # fmt: skip
    """One torchrun launch of ``script`` at ``ranks`` ranks (its own working directory: its own node memory);
    its output."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
        f"--max-restarts={restarts}", "--monitor-interval=0.1", str(script), f"--run.root={root}", f"--run.name={name}",
        "--checkpoint.every_steps=20", "--data.ledger=true", "--logging.every_steps=1", *flags,
    ]  # fmt: skip
    cwd = root / f"cwd-{name}"
    cwd.mkdir(parents=True, exist_ok=True)
    extra = {"TORCHINDUCTOR_CACHE_DIR": str(root / "inductor-cache")}
    if fault:
        extra["ELASTIC_DDP_FAULT"] = fault
    done = subprocess.run(command, env=env(**extra), cwd=cwd, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    return output


def resume_records(root: Path, name: str) -> list[dict]:
    lines = (root / name / "failures.jsonl").read_text(encoding="utf-8").splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == "resume"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("compiled")


@pytest.fixture(scope="module")
def uninterrupted(root) -> str:
    run(root, "whole", f"--train.max_steps={STEPS}", "--train.compile=true", "--checkpoint.memory_every_steps=1")
    return "whole"


def test_a_compiled_run_killed_mid_run_resumes_from_node_memory_with_the_exact_state(root, uninterrupted):
    name = "killed"
    # A node-memory save after every step: the last comparison of the ranks' values is at most a step
    # old when the survivors keep theirs. (Further apart, the BatchNorm counter -- stored once for
    # every rank, changed by every step -- keeps a survivor from vouching alone for the steps since,
    # compiled or not: docs/your-model.md, "Compiled models".)
    output = run(root, name, f"--train.max_steps={STEPS}", "--train.compile=true", "--checkpoint.memory_every_steps=1",
                 fault="kill@8:rank=1:restart=0", restarts=1)  # fmt: skip
    assert "Resumed from the memory tier" in output, output[-4000:]
    [record] = resume_records(root, name)
    # The survivors keep the last completed step in node memory: at most the step in flight is redone.
    print(f"compiled, killed at step 8: resumed from the {record['tier']} tier at step {record['step']}, "
          f"{record['steps_redone']} step(s) redone")  # fmt: skip
    assert record["tier"] == "memory" and 0 <= record["steps_redone"] <= 1, record
    for rank in range(RANKS):
        assert_same_state(final_state(root, name, rank), final_state(root, uninterrupted, rank), f"rank {rank}")
    history, want = read_ledger(root / name), read_ledger(root / uninterrupted)
    assert list(history) == list(range(1, STEPS + 1))
    assert [e.loss for e in history.values()] == [e.loss for e in want.values()]


@pytest.mark.parametrize(("first", "then"), [("eager", "compiled"), ("compiled", "eager")])
def test_compiled_and_eager_runs_resume_each_others_checkpoints(root, uninterrupted, first, then):
    name = f"{first}-then-{then}"
    compile_flag = {"eager": "--train.compile=false", "compiled": "--train.compile=true"}
    run(root, name, f"--train.max_steps={STEPS}", "--train.exit_at_step=6", "--checkpoint.memory_overhead=0",
        compile_flag[first])  # fmt: skip
    output = run(root, name, f"--train.max_steps={STEPS}", "--checkpoint.memory_overhead=0", compile_flag[then])
    assert "Resumed from the durable tier at step 6" in output, output[-4000:]
    assert list(read_ledger(root / name)) == list(range(1, STEPS + 1))
    index = json.loads((root / name / "checkpoints" / f"step-{STEPS:09d}" / "index.json").read_text())
    assert "_orig_mod" not in json.dumps(index["state"]), index["state"]["model"]  # the plain module's names


def test_a_compiled_run_resized_from_3_to_2_ranks_trains_on_with_the_same_samples(root, uninterrupted):
    name = "resized"
    run(root, name, f"--train.max_steps={STEPS}", "--train.exit_at_step=6", "--train.compile=true")
    output = run(root, name, f"--train.max_steps={STEPS}", "--train.compile=true", ranks=2)
    assert "Resumed from the durable tier at step 6" in output or "Resumed from the memory tier at step 6" in output, \
        output[-4000:]
    history, want = read_ledger(root / name), read_ledger(root / uninterrupted)
    assert list(history) == list(range(1, STEPS + 1))
    # The same samples at every step, whatever the world size; the split over ranks follows it.
    assert [e.all_indices for e in history.values()] == [e.all_indices for e in want.values()]
    assert {e.world_size for s, e in history.items() if s <= 6} == {3}
    assert {e.world_size for s, e in history.items() if s > 6} == {2}


def test_the_compiled_language_model_recipe_killed_at_3_ranks_resumes_bitwise_with_at_most_a_step_redone(
    root, etcd_endpoint
):
    # The recipe as users run it compiled, on 3 machines of one rank each through etcd, the memory tier
    # at its default budget: when a worker dies, the survivors keep the last completed step in their
    # node memory (no BatchNorm in this model). The uninterrupted run for comparison: the same 3 ranks.
    flags = [f"--train.max_steps={STEPS}", "--train.compile=true", "--data.ledger=true", "--checkpoint.every_steps=20"]
    run(root, "lm-whole", *TINY, "--logging.every_steps=1", *flags, script=RECIPE)
    job = Job(
        etcd_endpoint, root, nnodes="3", run_id="lm-killed", recipe=RECIPE, flags=flags,
        extra_env={"ELASTIC_DDP_FAULT": "kill@8:rank=2:restart=0", "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor-cache")},
    )  # fmt: skip
    try:
        for machine in "abc":
            job.add_node(flags=[f"--checkpoint.memory_dir={root / f'shm-{machine}'}"])
        codes = [node.wait(timeout=400) for node in job.nodes]
    finally:
        job.cleanup()
    assert codes == [0, 0, 0], job.output()[-6000:]
    [record] = resume_records(root, "lm-killed")
    assert record["tier"] == "memory" and 0 <= record["steps_redone"] <= 1, (record, job.output()[-4000:])
    got, want = read_ledger(root / "lm-killed"), read_ledger(root / "lm-whole")
    assert list(got) == list(range(1, STEPS + 1))
    assert [e.loss for e in got.values()] == [e.loss for e in want.values()]
    models = {}
    for name in ("lm-whole", "lm-killed"):
        out = root / f"{name}-model.pt"
        assert ckpt_cli.main(["ckpt", "export", str(root / name / "checkpoints" / f"step-{STEPS:09d}"), str(out),
                              "--object", "model"]) == 0  # fmt: skip
        models[name] = torch.load(out, weights_only=True)
    want, got = models["lm-whole"], models["lm-killed"]
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
