"""Classify handwritten digits with elastic, fault-tolerant DDP: an ordinary model on the public API.

The data is scikit-learn's ``load_digits`` (1,797 images of 8x8 pixels, 10 classes), which ships
inside the package: nothing is downloaded. The model is a plain ``nn.Module`` with ``nn.Dropout``,
trained with SGD and momentum, a ``StepLR`` schedule, and mixed precision (``torch.autocast`` with a
``GradScaler``) on CUDA. Everything between the imports and ``launch`` is what any DDP script has;
the lines that mention ``edp``/``run``/``step`` are all it takes to make it elastic.

One machine, two processes (a relaunch of the same line resumes)::

    torchrun --standalone --nproc-per-node=2 recipes/train_classifier.py --train.max_steps=200

Several machines joined through etcd (the same line on every machine)::

    torchrun --nnodes=1:4 --nproc-per-node=8 --max-restarts=3 \
        --rdzv-backend=etcd --rdzv-endpoint=etcd-0:2379 --rdzv-id=digits \
        recipes/train_classifier.py --config recipes/configs/classifier.yaml --checkpoint.url=s3://bucket/digits
"""

from typing import ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import Dataset

import elastic_ddp as edp


class ModelSettings(edp.Section):
    identity: ClassVar[bool] = True  # these shape the weights: a resume with other values is refused

    hidden: int = Field(default=64, gt=0, description="Width of the hidden layer.")
    dropout: float = Field(default=0.1, ge=0, lt=1, description="Dropout probability (nn.Dropout).")


class OptimSettings(edp.Section):
    lr: float = Field(default=0.05, gt=0, description="SGD learning rate.")
    momentum: float = Field(default=0.9, ge=0, lt=1, description="SGD momentum.")
    weight_decay: float = Field(default=1e-4, ge=0, description="SGD weight decay.")
    step_size: int = Field(default=100, gt=0, description="StepLR: steps between learning-rate decays.")
    gamma: float = Field(default=0.5, gt=0, le=1, description="StepLR: decay factor.")


class Train(edp.TrainConfig):
    """The library's ``train`` section plus whether to compile the model."""

    compile: bool = Field(
        default=False,
        description=(
            "Compile the model with torch.compile (the first step of each worker start then takes longer). "
            "Checkpoints are the same as an eager run's: either resumes the other's."
        ),
    )


class Settings(edp.Config):
    train: Train = Field(default_factory=Train)
    model: ModelSettings = Field(default_factory=ModelSettings)
    optim: OptimSettings = Field(default_factory=OptimSettings)


class Digits(Dataset):
    """scikit-learn's 8x8 digits as ``(image [1, 8, 8] in 0..1, label)`` pairs."""

    def __init__(self) -> None:
        images, labels = load_digits(return_X_y=True)
        self.images = torch.tensor(images, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
        self.labels = torch.tensor(labels, dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[index], self.labels[index]


class Net(nn.Module):
    def __init__(self, cfg: ModelSettings) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Dropout(cfg.dropout), nn.Linear(32 * 4 * 4, cfg.hidden), nn.ReLU(),
            nn.Dropout(cfg.dropout), nn.Linear(cfg.hidden, 10),
        )  # fmt: skip

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


def train(run: edp.Run) -> None:
    cfg = run.cfg
    model = Net(cfg.model).to(run.device)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=cfg.optim.lr, momentum=cfg.optim.momentum, weight_decay=cfg.optim.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=cfg.optim.step_size, gamma=cfg.optim.gamma)
    amp = run.device.type == "cuda"  # float16 autocast needs the scaler; on the CPU both are off
    scaler = torch.amp.GradScaler(run.device.type, enabled=amp)
    # Compiled before setup: DDP wraps the compiled module, and checkpoints keep the plain module's names.
    ddp_model = run.setup(torch.compile(model) if cfg.train.compile else model, optimizer, scheduler, scaler=scaler)

    for step in run.steps(Digits()):
        for images, labels in step:
            with torch.autocast(run.device.type, dtype=torch.float16, enabled=amp):
                loss = F.cross_entropy(ddp_model(images), labels)
            step.backward(loss, scaler)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    edp.launch(train, Settings)
