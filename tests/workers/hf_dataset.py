"""A training script over a Hugging Face ``datasets.Dataset``: 1,000 rows built with ``from_dict``,
``with_format("torch")``, passed to ``run.steps()`` as it is (the library's default collate, and the
dataset's own fingerprint in the checkpoint).

Each row carries its own index in ``id``, so every micro-batch checks that it holds exactly the rows
the data order assigned to it (``step.micro.indices``), in that order.
"""

import math

import datasets
import torch
import torch.nn.functional as F
from torch import nn

import elastic_ddp as edp

ROWS = 1000


def rows() -> datasets.Dataset:
    x = [[math.sin(i), math.cos(i), (i % 97) / 97] for i in range(ROWS)]
    y = [2 * a - b + 0.5 * c for a, b, c in x]
    return datasets.Dataset.from_dict({"id": list(range(ROWS)), "x": x, "y": y}).with_format("torch")


def train(run: edp.Run) -> None:
    model = nn.Linear(3, 1).to(run.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ddp_model = run.setup(model, optimizer)
    for step in run.steps(rows()):
        for batch in step:  # {"id": [n], "x": [n, 3], "y": [n]}: default_collate of the rows' dicts
            if batch["id"].tolist() != step.micro.indices:
                raise RuntimeError(f"Step {step.number} got rows {batch['id'].tolist()}, not {step.micro.indices}.")
            step.backward(F.mse_loss(ddp_model(batch["x"]).squeeze(1), batch["y"]))
        optimizer.step()
        optimizer.zero_grad()


if __name__ == "__main__":
    edp.launch(train)
