"""Train a byte-level transformer language model with elastic, fault-tolerant DDP.

One machine, two processes (no etcd needed; a relaunch of the same line resumes)::

    torchrun --standalone --nproc-per-node=2 recipes/train.py --train.max_steps=200

Several machines, 1 to 4 of them, joined through etcd (run the same line on every machine)::

    torchrun --nnodes=1:4 --nproc-per-node=8 --max-restarts=3 \
        --rdzv-backend=etcd --rdzv-endpoint=etcd-0:2379,etcd-1:2379,etcd-2:2379 --rdzv-id=my-run \
        recipes/train.py --config recipes/configs/lm-gpu.yaml --checkpoint.url=s3://bucket/my-run \
        --train.compile=true

The local demo (a bundled etcd and 2 agents on this machine)::

    make demo

Nodes may leave (preemption, failure) and join while the job runs: torchrun restarts the workers
at the new world size and the run resumes from the newest committed, verified checkpoint,
consuming exactly the samples the uninterrupted run would have consumed. Settings: the library's
sections (``elastic_ddp/config/sections.py``) plus the three below; ``--config FILE`` and
``--section.field=value`` set them.
"""

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator

import elastic_ddp as edp

# The model and corpus live beside this file, in recipes/lm/: a script's own directory comes first
# on sys.path.
from lm import (
    ByteGPT, ByteGPTConfig, ByteWindows, CorpusConfig, corpus_fingerprint, load_corpus, optimizer_groups, warmup_cosine,
)  # fmt: skip


class Train(edp.TrainConfig):
    """The library's ``train`` section plus this recipe's optimizer settings and whether to compile."""

    lr: float = Field(default=3e-3, gt=0, description="Peak learning rate (AdamW).")
    min_lr: float = Field(default=3e-4, ge=0, description="Learning rate at the end of the cosine decay.")
    warmup_steps: int = Field(default=20, ge=0, description="Steps of linear learning-rate warm-up.")
    weight_decay: float = Field(default=0.1, ge=0, description="AdamW weight decay (matrices and embeddings).")
    grad_clip: float = Field(default=1.0, ge=0, description="Clip the global gradient norm to this. 0: off.")
    compile: bool = Field(
        default=False,
        description=(
            "Compile the model with torch.compile (the first step of each worker start then takes longer). "
            "Checkpoints are the same as an eager run's: either resumes the other's."
        ),
    )

    @model_validator(mode="after")
    def _check_lr(self) -> "Train":
        if self.min_lr > self.lr:
            raise ValueError(f"train.min_lr ({self.min_lr}) must not exceed train.lr ({self.lr}).")
        return self


class Settings(edp.Config):
    train: Train = Field(default_factory=Train)
    model: ByteGPTConfig = Field(default_factory=ByteGPTConfig)
    data: CorpusConfig = Field(default_factory=CorpusConfig)  # with no flags: the stdlib's own sources


def train(run: edp.Run) -> None:
    cfg = run.cfg
    corpus = load_corpus(cfg.data)
    model = ByteGPT(cfg.model).to(run.device)
    optimizer = torch.optim.AdamW(optimizer_groups(model, cfg.train.weight_decay), lr=cfg.train.lr, betas=(0.9, 0.95))
    # Warm-up, then cosine decay: a pure function of the step, saved and restored with the scheduler.
    schedule = warmup_cosine(cfg.train.warmup_steps, cfg.train.max_steps, cfg.train.min_lr / cfg.train.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    # Compiled before setup: DDP wraps the compiled module, and checkpoints keep the plain module's names.
    ddp_model = run.setup(torch.compile(model) if cfg.train.compile else model, optimizer, scheduler)

    # The fingerprint ties the checkpoints to these bytes: other data would make the cursor lie.
    for step in run.steps(ByteWindows(corpus, cfg.model.block_size), fingerprint=corpus_fingerprint(corpus)):
        for x, y in step:
            # Per-sample dropout seeds: the same masks at any world size (nn.Dropout: the same size only).
            logits = ddp_model(x, step.micro.sample_seeds)
            step.backward(F.cross_entropy(logits.flatten(0, 1), y.flatten()))
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip or float("inf"))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step.log(grad_norm=grad_norm)


if __name__ == "__main__":
    edp.launch(train, Settings)
