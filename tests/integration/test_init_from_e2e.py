"""recipes/train_classifier.py under torchrun started from another run's safetensors export
(``--checkpoint.init_from``): step 1 starts from exactly those weights; killed with ``kill -9`` after
its step-20 commit and relaunched with the same flags, it resumes step 20 -- not the pretrained
file -- and every manifest names the source with its BLAKE3."""

from __future__ import annotations

from pathlib import Path

import blake3
import pytest
import torch
from safetensors.torch import load_file

from elastic_ddp.tools import checkpoint as ckpt_cli
from elastic_ddp.checkpoint.catalog import list_checkpoints
from elastic_ddp.checkpoint.storage import Storage
from tests.helpers.job import resumed_steps
from tests.integration.test_classifier_e2e import HALF, MAX_STEPS, run

pytestmark = pytest.mark.slow

INITIALISED = "event: Initialised the model from "


def export(job_dir: Path, step: int, out: Path, fmt: str) -> None:
    ckpt = job_dir / "checkpoints" / f"step-{step:09d}"
    assert ckpt_cli.main(["ckpt", "export", str(ckpt), str(out), "--format", fmt]) == 0


def test_fine_tune_starts_from_the_export_and_a_resume_wins_over_it(etcd_endpoint, tmp_path, capsys) -> None:
    # The other run: 10 steps, exported as safetensors.
    run(etcd_endpoint, tmp_path, "base", nproc=2, attempt="only", dropout=0.1, flags=["--train.exit_at_step=10"]).finish()
    base = tmp_path / "base.safetensors"
    export(tmp_path / "base", 10, base, "safetensors")
    source = {"url": str(base), "format": "safetensors", "blake3": blake3.blake3(base.read_bytes()).hexdigest()}
    init = [f"--checkpoint.init_from={base}"]

    # Step 1 from those weights, bitwise: a step whose update (lr 1e-30, no weight decay) is far below
    # float32's resolution leaves the weights as they were loaded, and its checkpoint holds them.
    frozen = ["--optim.lr=1e-30", "--optim.weight_decay=0", "--train.exit_at_step=1"]
    output = run(etcd_endpoint, tmp_path, "probe", nproc=2, attempt="only", dropout=0.1, flags=[*init, *frozen]).finish()
    assert f"{INITIALISED}{base} (safetensors, BLAKE3 {source['blake3']})" in output, output[-4000:]
    export(tmp_path / "probe", 1, tmp_path / "probe.pt", "torch")
    want, got = load_file(base), torch.load(tmp_path / "probe.pt", weights_only=True)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)

    # The fine-tune: rank 0 stalls at the start of step 25, the node is killed after step 20 committed.
    durable_only = ["--checkpoint.memory_overhead=0"]
    first = run(etcd_endpoint, tmp_path, "tuned", nproc=2, attempt="first", dropout=0.1, flags=[*init, *durable_only],
                env={"ELASTIC_DDP_FAULT": "hang@25:rank=0:restart=0"})  # fmt: skip
    first.wait_for_commit(HALF, timeout=180)
    first.wait_for_step(24)
    first.nodes[0].kill()
    first.cleanup()
    assert INITIALISED in first.output()
    again = run(etcd_endpoint, tmp_path, "tuned", nproc=2, attempt="again", dropout=0.1, flags=[*init, *durable_only])
    output = again.finish()
    assert resumed_steps(output) == [HALF], output[-4000:]
    assert INITIALISED not in output  # a resume always wins: the pretrained file is not read again

    infos = list_checkpoints(Storage(str(tmp_path / "tuned" / "checkpoints")))
    assert [info.step for info in infos] == list(range(10, MAX_STEPS + 1, 10))
    assert all(info.manifest.get("init_from") == source for info in infos)  # carried across the resume
    capsys.readouterr()
    assert ckpt_cli.main(["ckpt", "list", str(tmp_path / "tuned" / "checkpoints")]) == 0
    assert f"Initialised from {base} (safetensors, BLAKE3 {source['blake3']}): steps 10-40." in capsys.readouterr().out
