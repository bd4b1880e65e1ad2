"""A training script over a sharded source (``edp.Shards``): the shards ``SHARDS_URL`` (a glob) in the format
``SHARDS_FORMAT``, the shard index at ``SHARDS_INDEX`` (tests/helpers/shards.py writes them).

Each record carries its own index in the source (``id``), so every micro-batch checks that it holds exactly
the records the data order assigned to it (``step.micro.indices``), in that order.
"""

import json
import os

import torch
import torch.nn.functional as F
from torch import nn

import elastic_ddp as edp


def collate(samples: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    records = [json.loads(s["json"]) if "__key__" in s else s for s in samples]  # WebDataset: the .json member
    return (torch.tensor([r["id"] for r in records]), torch.tensor([r["x"] for r in records]),
            torch.tensor([r["y"] for r in records]))  # fmt: skip


def train(run: edp.Run) -> None:
    source = edp.Shards(os.environ["SHARDS_URL"], os.environ["SHARDS_FORMAT"], shards_in_flight=4, shuffle_window=16,
                        index_url=os.environ["SHARDS_INDEX"])  # fmt: skip
    model = nn.Linear(3, 1).to(run.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ddp_model = run.setup(model, optimizer)
    for step in run.steps(source, collate_fn=collate):
        for ids, x, y in step:
            if ids.tolist() != step.micro.indices:
                raise RuntimeError(f"Step {step.number} got records {ids.tolist()}, not {step.micro.indices}.")
            step.backward(F.mse_loss(ddp_model(x).squeeze(1), y))
        optimizer.step()
        optimizer.zero_grad()


if __name__ == "__main__":
    edp.launch(train)
