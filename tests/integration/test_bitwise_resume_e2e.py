"""Bitwise same-world-size resume at 3 ranks (and at 4 for BatchNorm + EMA), where a sum over ranks
depends on its order.

At 2 ranks ``a + b == b + a`` hides any difference in how an attempt reduces its gradients; at 3
it does not: a run stopped at step 20 and resumed to 40 must still end with the parameters of an
uninterrupted 40-step run, and log the same loss at every step (the ledger keeps them at full
precision). Both recipes, and the BatchNorm + EMA script (tests/workers/ordinary_model.py), whose
every rank's model, buffers and EMA are compared. Under real torchrun (CPU, gloo).
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from elastic_ddp.tools import checkpoint as ckpt_cli
from elastic_ddp.data import read_ledger
from tests.helpers.job import CLASSIFIER, RECIPE, REPO, TINY, TINY_CLASSIFIER, env

pytestmark = pytest.mark.slow

ORDINARY = REPO / "tests" / "workers" / "ordinary_model.py"
STEPS, HALF = 40, 20
SCRIPTS = {"lm": (RECIPE, TINY), "classifier": (CLASSIFIER, TINY_CLASSIFIER), "batchnorm": (ORDINARY, [])}


def launch(root: Path, script: str, name: str, ranks: int, *flags: str) -> str:
    path, tiny = SCRIPTS[script]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(path),
        f"--run.root={root}", f"--run.name={name}", f"--train.max_steps={STEPS}", "--data.ledger=true",
        "--checkpoint.every_steps=10", *tiny, "--logging.every_steps=10", *flags,
    ]  # fmt: skip
    cwd = root / f"cwd-{name}"
    cwd.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(command, env=env(), cwd=cwd, capture_output=True, text=True, timeout=400)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    return output


def exported(root: Path, name: str, what: str) -> dict:
    out = root / f"{name}-{what}.pt"
    ckpt = root / name / "checkpoints" / f"step-{STEPS:09d}"
    assert ckpt_cli.main(["ckpt", "export", str(ckpt), str(out), "--object", what]) == 0
    return torch.load(out, weights_only=True)


def losses(root: Path, name: str) -> list[float]:
    history = read_ledger(root / name)
    assert list(history) == list(range(1, STEPS + 1))
    return [entry.loss for entry in history.values()]


def logged_steps(tensorboard_dir: Path, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tensorboard_dir), size_guidance={"scalars": 0})
    events.Reload()
    return [event.step for event in events.Scalars(tag)]


# Every script at 3 ranks, where a sum over ranks first depends on its order; the BatchNorm + EMA
# script, whose ranks each keep buffers of their own, at 4 as well (another reduction schedule).
@pytest.mark.parametrize(("script", "ranks"), [("lm", 3), ("classifier", 3), ("batchnorm", 3), ("batchnorm", 4)])
def test_a_run_stopped_at_20_and_resumed_ends_bitwise_equal_to_an_uninterrupted_run(tmp_path, script, ranks):
    # The two runs are independent: run them side by side (the resumed one's halves in order).
    with ThreadPoolExecutor(2) as pool:
        whole = pool.submit(launch, tmp_path, script, "whole", ranks)
        launch(tmp_path, script, "resumed", ranks, f"--train.exit_at_step={HALF}")
        # The memory tier holds step 20 too; the durable tier is what a new machine would resume.
        output = launch(tmp_path, script, "resumed", ranks, "--checkpoint.memory_overhead=0")
        whole.result()
    # The ledger records every step; the metrics keep their own cadence (every 10 steps).
    logged = logged_steps(tmp_path / "whole" / "tensorboard", "train/loss")
    assert logged and set(logged) <= {1, *range(10, STEPS + 1, 10)}, logged
    assert f"Resumed from the durable tier at step {HALF}" in output, output[-4000:]
    assert losses(tmp_path, "resumed") == losses(tmp_path, "whole")
    want, got = exported(tmp_path, "whole", "model"), exported(tmp_path, "resumed", "model")
    assert want.keys() == got.keys()
    differ = [key for key in want if not torch.equal(want[key], got[key])]
    assert not differ, f"{len(differ)} of {len(want)} tensors differ: {differ[:5]}"
    if script == "batchnorm":
        for rank in range(ranks):
            final = [torch.load(tmp_path / n / f"final-rank{rank}.pt", weights_only=True) for n in ("whole", "resumed")]
            for part in ("model", "ema", "counter", "late"):
                for key, value in final[0][part].items():
                    assert torch.equal(torch.as_tensor(final[1][part][key]), torch.as_tensor(value)), (rank, part, key)
