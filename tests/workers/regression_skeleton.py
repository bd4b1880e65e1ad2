"""A training script in the shape of docs/your-model.md's skeleton: a regression MLP on scikit-learn's
diabetes data (442 samples, 10 features, shipped inside the package), Adam and a LambdaLR schedule.

The lines that mention the library are the skeleton's; everything else is an ordinary PyTorch script.
"""

import torch
import torch.nn.functional as F
from pydantic import Field
from sklearn.datasets import load_diabetes
from torch import nn
from torch.utils.data import TensorDataset

import elastic_ddp as edp


class OptimSettings(edp.Section):
    lr: float = Field(default=1e-2, gt=0, description="Adam learning rate.")
    decay: float = Field(default=0.98, gt=0, le=1, description="LambdaLR: factor per step.")


class Settings(edp.Config):
    optim: OptimSettings = Field(default_factory=OptimSettings)


def diabetes() -> TensorDataset:
    features, target = load_diabetes(return_X_y=True, scaled=True)
    x = torch.tensor(features, dtype=torch.float32)
    y = torch.tensor(target, dtype=torch.float32).unsqueeze(1)
    return TensorDataset(x, (y - y.mean()) / y.std())


def train(run: edp.Run) -> None:
    model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1)).to(run.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=run.cfg.optim.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: run.cfg.optim.decay**s)
    ddp_model = run.setup(model, optimizer, scheduler)
    for step in run.steps(diabetes()):
        for x, y in step:
            step.backward(F.mse_loss(ddp_model(x), y))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


if __name__ == "__main__":
    edp.launch(train, Settings)
