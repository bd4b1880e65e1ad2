"""A training script over a sharded source (``edp.Shards``): the shards ``SHARDS_URL`` (a glob) in the format
``SHARDS_FORMAT``, the shard index at ``SHARDS_INDEX`` (tests/helpers/shards.py writes them).

Each record carries its own index in the source (``id``), so every micro-batch checks that it holds exactly
the records the data order assigned to it (``step.micro.indices``), in that order. With ``SHARDS_PACK=L`` the
records are documents of tokens (``tests.helpers.shards.tokens``) packed into sequences of ``L`` tokens, and
the script is a next-token predictor over them (``SHARDS_FORMAT=hf-parquet``: the shards as a Hugging Face
streaming dataset, through ``Shards.from_hf``). ``SHARDS_BAD=skip`` skips bad records.
"""

import json
import os

import torch
import torch.nn.functional as F
from torch import nn

import elastic_ddp as edp
from tests.helpers.shards import VOCABULARY, record_id, tokens


def collate(samples: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    records = [json.loads(s["json"]) if "__key__" in s else s for s in samples]  # WebDataset: the .json member
    return (torch.tensor([r["id"] for r in records]), torch.tensor([r["x"] for r in records]),
            torch.tensor([r["y"] for r in records]))  # fmt: skip


def packed_source(pack: int) -> edp.Shards:
    fmt = os.environ["SHARDS_FORMAT"]
    options = {"shards_in_flight": 4, "shuffle_window": 16, "index_url": os.environ["SHARDS_INDEX"], "pack_tokens": pack,
               "transform": lambda r: tokens({"id": record_id(fmt, r)})}  # fmt: skip
    if fmt == "hf-parquet":  # a Hugging Face streaming dataset over the Parquet shards
        import datasets

        stream = datasets.load_dataset("parquet", data_files=os.environ["SHARDS_URL"], split="train", streaming=True)
        return edp.Shards.from_hf(stream, **options)
    return edp.Shards(os.environ["SHARDS_URL"], fmt, **options)


def train_packed(run: edp.Run, pack: int) -> None:
    source = packed_source(pack)
    model = nn.Sequential(nn.Embedding(VOCABULARY, 8), nn.Linear(8, VOCABULARY)).to(run.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ddp_model = run.setup(model, optimizer)
    for step in run.steps(source):
        for sequences in step:
            if sequences.shape[1:] != (pack,):
                raise RuntimeError(f"Step {step.number} got sequences of shape {tuple(sequences.shape)}, not (n, {pack}).")
            inputs = sequences % VOCABULARY
            logits = ddp_model(inputs[:, :-1])
            step.backward(F.cross_entropy(logits.reshape(-1, VOCABULARY), inputs[:, 1:].reshape(-1)))
        optimizer.step()
        optimizer.zero_grad()


def train(run: edp.Run) -> None:
    if os.environ.get("SHARDS_PACK"):
        return train_packed(run, int(os.environ["SHARDS_PACK"]))
    source = edp.Shards(os.environ["SHARDS_URL"], os.environ["SHARDS_FORMAT"], shards_in_flight=4, shuffle_window=16,
                        index_url=os.environ["SHARDS_INDEX"], on_bad_record=os.environ.get("SHARDS_BAD", "error"))  # fmt: skip
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
