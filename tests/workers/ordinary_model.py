"""An ordinary user's training script, written from docs/your-model.md: dict samples with a padding
``collate_fn``, BatchNorm (2d and 1d) and dropout, AdamW with OneCycleLR, gradient clipping, an EMA
of the weights *and buffers* (``AveragedModel(..., use_buffers=True)``) registered as is, and a
counter whose value differs per rank. Nothing in it knows that BatchNorm statistics differ across
ranks under DDP: the library must keep that right by itself.

At the end of the run every rank writes what it holds to ``<run dir>/final-rank<R>.pt`` (model,
EMA, counter), for the tests to compare with another run's. ``--train.compile=true`` hands
``torch.compile(model)`` to ``run.setup``, as users of compiled models do.
"""

import torch
import torch.nn.functional as F
from pydantic import Field
from sklearn.datasets import load_digits
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import Dataset

import elastic_ddp as edp


class ModelSettings(edp.Section):
    hidden: int = Field(default=32, gt=0, description="Width of the hidden layer.")
    dropout: float = Field(default=0.2, ge=0, lt=1, description="Dropout probability.")
    ema_decay: float = Field(default=0.9, gt=0, lt=1, description="Decay of the EMA of the weights.")


class Train(edp.TrainConfig):
    compile: bool = Field(default=False, description="Hand torch.compile(model) to run.setup, as users do.")


class Settings(edp.Config):
    train: Train = Field(default_factory=Train)
    model: ModelSettings = Field(default_factory=ModelSettings)


class Digits(Dataset):
    """scikit-learn's 8x8 digits as dicts; every 7th image is cropped to 7 rows (the collate pads it)."""

    def __init__(self) -> None:
        images, labels = load_digits(return_X_y=True)
        self.images = torch.tensor(images, dtype=torch.float32).view(-1, 8, 8) / 16.0
        self.labels = torch.tensor(labels, dtype=torch.int64)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        image = self.images[i][:7] if i % 7 == 0 else self.images[i]
        return {"image": image, "label": self.labels[i]}


def pad_collate(samples: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = max(s["image"].shape[0] for s in samples)
    images = torch.stack([F.pad(s["image"], (0, 0, 0, rows - s["image"].shape[0])) for s in samples])
    return images.unsqueeze(1), torch.stack([s["label"] for s in samples])


class Net(nn.Module):
    def __init__(self, hidden: int, dropout: float) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.bn2d = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 4 * 4, hidden)
        self.bn1d = nn.BatchNorm1d(hidden)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.adaptive_avg_pool2d(F.relu(self.bn2d(self.conv(x))), 4).flatten(1)
        return self.out(self.drop(F.relu(self.bn1d(self.fc(x)))))


class SeenCounter:
    """What this rank has trained on: values that differ per rank (Python ints and a tensor)."""

    def __init__(self) -> None:
        self.samples = 0
        self.last_index = -1
        self.per_class = torch.zeros(10, dtype=torch.int64)

    def state_dict(self) -> dict:
        return {"samples": self.samples, "last_index": self.last_index, "per_class": self.per_class}

    def load_state_dict(self, state: dict) -> None:
        self.samples, self.last_index = state["samples"], state["last_index"]
        self.per_class.copy_(state["per_class"])


class LateStatistic:
    """A running sum of this rank's first sample index from step 10 on: the same on every rank
    before (zeros), different after -- like an EMA that starts late."""

    def __init__(self) -> None:
        self.total = torch.zeros(2)

    def state_dict(self) -> dict:
        return {"total": self.total}

    def load_state_dict(self, state: dict) -> None:
        self.total.copy_(state["total"])


def train(run: edp.Run) -> None:
    cfg = run.cfg.model
    model = Net(cfg.hidden, cfg.dropout).to(run.device)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(cfg.ema_decay), use_buffers=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-2, total_steps=run.cfg.train.max_steps)
    counter, late = SeenCounter(), LateStatistic()
    ddp_model = run.setup(torch.compile(model) if run.cfg.train.compile else model, optimizer, scheduler, ema=ema,
                          counter=counter, late=late)  # fmt: skip
    for step in run.steps(Digits(), collate_fn=pad_collate):
        for images, labels in step:
            step.backward(F.cross_entropy(ddp_model(images), labels))
            counter.samples += len(labels)
            counter.per_class += torch.bincount(labels.cpu(), minlength=10)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        ema.update_parameters(model)
        counter.last_index = step.indices[-1]
        if step.number >= 10:
            late.total += torch.tensor([float(step.indices[0]), 1.0])
        step.log(grad_norm=norm)
    if run.step == run.cfg.train.max_steps:
        final = {"model": model.state_dict(), "ema": ema.state_dict(), "counter": counter.state_dict(),
                 "late": late.state_dict()}
        torch.save(final, f"{run.cfg.run.dir}/final-rank{run.rank}.pt")


if __name__ == "__main__":
    edp.launch(train, Settings)
