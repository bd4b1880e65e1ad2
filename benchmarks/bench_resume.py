"""Load/resume: time to a resumed first step, CheckpointManager vs torch.load of the same state.

One process. The state is saved once by each method (untimed); then, alternately, a fresh model
and optimizer of the same shape (built untimed) are resumed and take one training step:
``manager`` = a new CheckpointManager, ``resolve("auto")`` (finds the newest committed checkpoint
and verifies every file's size and SHA-256), ``load``, step; ``torch.load`` = ``torch.load``
(weights_only), ``load_state_dict`` for model and optimizer, step. The files are in the page cache
for both (written just before).
"""

from __future__ import annotations

import time

from benchmarks.bench_checkpoint import manager
from benchmarks.common import Context, Result, alternate, ratios, row
from benchmarks.state import build_state, fresh_like, torch_load, torch_save

NAME = "resume"
TITLE = "Load/resume: time to the first resumed step, manager vs torch.load"


def run(ctx: Context) -> Result:
    megabytes = 4 if ctx.smoke else 512
    root = ctx.scratch(NAME)
    state = build_state(megabytes)
    url, pt = str(root / "ckpt"), str(root / "state.pt")
    saver = manager(url, async_save=False)
    saver.save(1, state.objects(), blocking=True)
    saver.close()
    torch_save(state, pt)

    def via_manager(i: int) -> dict[str, float]:
        target = fresh_like(state, seed=10 + i)
        start = time.perf_counter()
        mgr = manager(url, async_save=False)
        info = mgr.resolve("auto")
        if info is None:
            raise RuntimeError(f"The manager found no checkpoint under {url}.")
        mgr.load(info, target.objects())
        loaded = time.perf_counter()
        target.step()
        end = time.perf_counter()
        mgr.close()
        return {"to_first_step_s": end - start, "load_s": loaded - start}

    def via_torch_load(i: int) -> dict[str, float]:
        target = fresh_like(state, seed=10 + i)
        start = time.perf_counter()
        torch_load(target, pt)
        loaded = time.perf_counter()
        target.step()
        end = time.perf_counter()
        return {"to_first_step_s": end - start, "load_s": loaded - start}

    samples = alternate({"manager": via_manager, "torch_load": via_torch_load}, ctx.repeats)
    m, t = samples["manager"], samples["torch_load"]
    return Result(
        NAME,
        TITLE,
        params={"state_bytes": state.nbytes, "repeats": ctx.repeats},
        samples=samples,
        rows=[
            row("manager: resolve + verify + load", m["load_s"], "s"),
            row("manager: to first resumed step", m["to_first_step_s"], "s"),
            row("torch.load + load_state_dict", t["load_s"], "s"),
            row("torch.load: to first resumed step", t["to_first_step_s"], "s"),
            row("to first step: manager / torch.load", ratios(m["to_first_step_s"], t["to_first_step_s"]), "ratio",
                note="includes SHA-256 verification of every file"),
        ],
    )
