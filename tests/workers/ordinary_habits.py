"""A script with the habits of ordinary training scripts, none of which knows about warm workers or
the library's exit: an environment variable set before ``import torch``, a thread pool left alive
(an uploader), an ``atexit`` handler, a logging handler of its own, a ``tqdm`` progress bar and
DataLoader worker processes (``--data.num_workers``).

Each attempt of each rank appends what it sees to ``<run dir>/attempts-rank<R>.jsonl``; at its exit
each rank's ``atexit`` handler writes ``<run dir>/atexit-rank<R>.txt``.
"""

import os

# As torch's documentation shows it: set before torch is imported, which reads it then.
os.environ["TORCHINDUCTOR_MAX_AUTOTUNE"] = "1"
# A variable of the script's own, which nothing imported reads: a warm worker honours it as it is.
os.environ.setdefault("HABITS_MODE", "test")

import atexit  # noqa: E402
import concurrent.futures  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch._inductor.config  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402
from tqdm import tqdm  # noqa: E402

import elastic_ddp as edp  # noqa: E402

uploads = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="uploader")  # never shut down
log = logging.getLogger("habits")


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(512, 8, generator=generator)
    return TensorDataset(x, (x.sum(1, keepdim=True) > 0).float())


def train(run: edp.Run) -> None:
    out = Path(run.cfg.run.dir)
    out.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(out / f"habits-rank{run.rank}.log")  # never closed by the script
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    with open(out / f"attempts-rank{run.rank}.jsonl", "a", encoding="utf-8") as attempts:
        attempts.write(json.dumps({
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), "pid": os.getpid(),
            "max_autotune": torch._inductor.config.max_autotune, "mode": os.environ.get("HABITS_MODE"),
        }) + "\n")  # fmt: skip
    atexit.register(lambda: (out / f"atexit-rank{run.rank}.txt").write_text(f"atexit ran after step {run.step}"))

    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1)).to(run.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    ddp_model = run.setup(model, optimizer)
    progress = tqdm(total=run.cfg.train.max_steps, initial=run.step, disable=run.rank != 0, mininterval=0)
    for step in run.steps(data()):
        for x, y in step:
            step.backward(F.binary_cross_entropy_with_logits(ddp_model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        uploads.submit(log.info, "step %d done", step.number)
        progress.update(1)
    log.info("finished at step %d", run.step)


if __name__ == "__main__":
    edp.launch(train)
