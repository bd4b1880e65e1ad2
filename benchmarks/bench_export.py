"""``elastic-ddp ckpt export`` in each format vs ``torch.save`` of the same state, with the export's peak memory.

One checkpoint of a model-like state (``STATE_MB``: an embedding of a quarter of the bytes and
layers of equal size, float32; smoke: 48 MB) is saved once by a ``CheckpointManager``. Each
variant runs in a fresh child process, alternately: ``torch.save`` of the same state built in
memory (the floor), and ``elastic-ddp ckpt export --format F`` for F in torch, safetensors and dcp
(the whole command: verify the checkpoint, then stream the model from its files into the output,
every file verified again as it streams). Times are of that call alone (imports excluded); the
previous output is deleted, untimed, before each run. The checkpoint and the outputs are in the
page cache after the first repeat, as an export right after a run would find them.

Memory: the child's peak RSS during the call (``VmHWM``, reset through ``/proc/self/clear_refs``
just before it) minus its RSS then, i.e. what the call itself added at its peak, as a multiple of
the largest tensor and of the whole state (Linux only). The baseline is taken after the imports
every variant needs (torch, safetensors, DCP, this package's CLI); whatever the call imports or
allocates beyond them counts. Pages of the files read and written are page cache, not the
process's memory, and are not counted (no variant maps a file).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from benchmarks.common import Context, Result, Target, alternate, child_env, ratios, row

NAME = "export"
TITLE = "ckpt export (torch, safetensors, dcp) vs torch.save of the same state: time and peak memory"
STATE_MB = 1024
LAYERS = 12
FORMATS = ("torch", "safetensors", "dcp")
# Fixed costs beside the tensors an export may hold (its read buffers, 24 MiB; the writers' own).
BUFFERS_MB = 64

# One variant in a fresh process: prints {"s": seconds of the call, "peak_mb": RSS the call added at its peak}.
CHILD = r"""
import json, sys, time
import torch
import safetensors.torch
import torch.distributed.checkpoint
from elastic_ddp.tools import checkpoint as cli

def status_mb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024  # kB

def start_peak():
    # Writing 5 to clear_refs resets the peak (VmHWM) to the current RSS: what the imports and
    # building the state reached before does not count.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_mb("VmRSS")

def peak_mb():
    return status_mb("VmHWM")

mode, ckpt, out, shapes = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
if mode == "torch.save":
    gen = torch.Generator().manual_seed(0)
    state = {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}
    before = start_peak()
    started = time.perf_counter()
    torch.save(state, out)
else:
    before = start_peak()
    started = time.perf_counter()
    rc = cli.main(["ckpt", "export", ckpt, out, "--format", mode])
    assert rc == 0, rc
elapsed = time.perf_counter() - started
print(json.dumps({"s": elapsed, "peak_mb": max(peak_mb() - before, 0.0)}))
"""


def _shapes(state_mb: int) -> dict[str, list[int]]:
    """A model-like state of ``state_mb`` MB of float32: an embedding of a quarter, then equal layers."""
    width = 1024
    floats = state_mb * (1 << 20) // 4
    embedding_rows = floats // 4 // width
    layer_rows = (floats - embedding_rows * width) // LAYERS // width
    shapes = {"embed.weight": [embedding_rows, width]}
    shapes.update({f"layers.{i}.weight": [layer_rows, width] for i in range(LAYERS)})
    return shapes


def _save_checkpoint(root: str, shapes: dict[str, list[int]]) -> str:
    """Save the state once through a CheckpointManager; the checkpoint's URL."""
    import torch

    from elastic_ddp.checkpoint import CheckpointManager
    from elastic_ddp.config import CheckpointConfig

    gen = torch.Generator().manual_seed(0)
    model = {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}

    class Model:  # what run.setup() registers: an object with a state dict
        def state_dict(self) -> dict:
            return model

        def load_state_dict(self, state: dict) -> None:
            model.update(state)

    manager = CheckpointManager(CheckpointConfig(url=root), identity={})
    assert manager.save(1, {"model": Model()}, blocking=True) and manager.wait()
    return manager.latest().url


def _remove(path: str) -> None:
    """Delete an output: a file (torch, safetensors) or a directory (dcp)."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


def _run_child(mode: str, ckpt: str, out: str, shapes: dict[str, list[int]], timeout_s: float) -> dict[str, float]:
    _remove(out)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, mode, ckpt, out, json.dumps(shapes)],
        env=child_env(), capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the {mode} child failed ({done.returncode}): {done.stderr[-2000:]}")
    result = json.loads(done.stdout.splitlines()[-1])
    _remove(out)
    return result


def run(ctx: Context) -> Result:
    state_mb = 48 if ctx.smoke else STATE_MB
    timeout_s = 300 if ctx.smoke else 1200
    shapes = _shapes(state_mb)
    nbytes = {name: 4 * shape[0] * shape[1] for name, shape in shapes.items()}
    state_b, largest_b = sum(nbytes.values()), max(nbytes.values())
    scratch = ctx.scratch(NAME)
    ckpt = _save_checkpoint(str(scratch / "ckpt"), shapes)
    out = str(scratch / "out")
    variants = {
        mode: (lambda _, mode=mode: _run_child(mode, ckpt, out, shapes, timeout_s))
        for mode in ("torch.save", *FORMATS)
    }
    samples = alternate(variants, ctx.repeats)
    shutil.rmtree(scratch, ignore_errors=True)

    mb = 1 << 20
    memory_target = Target("<=", 1.2 + BUFFERS_MB * mb / largest_b)
    rows = [row("torch.save of the state in memory (floor)", samples["torch.save"]["s"], "s")]
    for fmt in FORMATS:
        s = samples[fmt]
        rows += [
            row(f"export --format {fmt}", s["s"], "s"),
            row(f"export --format {fmt} / torch.save", ratios(s["s"], samples["torch.save"]["s"]), "ratio"),
            row(
                f"export --format {fmt}: peak RSS added / largest tensor", [p * mb / largest_b for p in s["peak_mb"]],
                "ratio", memory_target, note=f"target: 1.2 x largest tensor + {BUFFERS_MB} MB",
            ),  # fmt: skip
            row(f"export --format {fmt}: peak RSS added / state", [p * mb / state_b for p in s["peak_mb"]], "ratio",
                Target("<=", 1.2), note="one copy of the state"),  # fmt: skip
        ]
    rows.append(
        row("torch.save: peak RSS added / state", [p * mb / state_b for p in samples["torch.save"]["peak_mb"]], "ratio",
            note="the state was built before the measurement starts: this is what saving adds")  # fmt: skip
    )
    return Result(
        NAME,
        TITLE,
        params={"state_bytes": state_b, "largest_tensor_bytes": largest_b, "tensors": len(shapes),
                "repeats": ctx.repeats, "dir": str(ctx.work_dir)},  # fmt: skip
        samples=samples,
        rows=rows,
        notes=[
            "An export times the whole command: a full verification pass over the checkpoint, a verified read of "
            "the model's files straight into its tensors, then the write; torch.save only writes a state already "
            "in memory, so the ratio includes reading the checkpoint twice.",
            "Each export streams: the checkpoint's files are read one after another through three 8 MiB buffers "
            "(hashed as they pass, each file checked against the manifest at its end), and torch and safetensors "
            "write each span of bytes straight to its place in the output (the header or the torch.save archive is "
            "written first, its storage records reserved), so they hold no tensor at all. DCP is handed each tensor "
            "whole, in the order the files complete them, a group of at most 32 MiB (or one larger tensor) per "
            ".distcp file: it holds about the largest tensor.",
        ],
    )
