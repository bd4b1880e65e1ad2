"""A local elastic job for integration tests: N torchrun agents running the recipe via etcd.

Each node's output goes to its own log; progress is read from rank 0's console lines
(``step=N/M loss=... world_size=W``) and from events (``event: Resumed from ... (step N)``).
Measured figures are printed as one ``RELIABILITY {json}`` line per scenario and, when
``ELASTIC_DDP_RELIABILITY_OUT`` names a file, appended to it (``benchmarks/reliability.py`` turns
them into docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from elastic_ddp.checkpoint.manager import list_checkpoints, verify_checkpoint
from elastic_ddp.checkpoint.storage import Storage
from elastic_ddp.data.ledger import LEDGER_DIR
from tests.helpers.nodes import Node, start_node, wait_for

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "train.py"
CLASSIFIER = REPO / "recipes" / "train_classifier.py"
ENV_RELIABILITY_OUT = "ELASTIC_DDP_RELIABILITY_OUT"

# A model and corpus small enough that a step takes milliseconds on a loaded 2-core machine.
TINY = [
    "--model.n_layer=1", "--model.n_head=2", "--model.n_embd=32", "--model.block_size=32",
    "--data.max_bytes=300000", "--train.global_batch_size=8", "--train.warmup_steps=2",
    "--logging.every_steps=1",
]  # fmt: skip
# The same for recipes/train_classifier.py (its model is small already).
TINY_CLASSIFIER = ["--train.global_batch_size=8", "--logging.every_steps=1"]

STEP_LINE = re.compile(r"step=(\d+)/(\d+) loss=([\d.]+).* world_size=(\d+)")
RESUMED_LINE = re.compile(r"event: Resumed from (\S+) \(step (\d+)\)")


def env(**extra: str) -> dict[str, str]:
    """A torchrun agent's environment: the repo importable, one thread per rank, workers forked warm
    (elastic_ddp.prestart, on by default; the test process itself turns it off, see conftest.py)."""
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "ELASTIC_DDP_PRESTART": "1", **extra}  # fmt: skip


def steps(output: str) -> list[tuple[int, int]]:
    """(step, world size) of every progress line in ``output``."""
    return [(int(m[1]), int(m[4])) for m in STEP_LINE.finditer(output)]


def resumed_steps(output: str) -> list[int]:
    return [int(m[2]) for m in RESUMED_LINE.finditer(output)]


# The nodes of a test start together on one machine: a run's first round need not wait out a
# cluster's start-up skew (first_round_timeout, 30 s by default) for nodes a test starts later.
TEST_RDZV_CONF = "--rdzv-conf=first_round_timeout=2"


@dataclass
class Job:
    """``torchrun`` agents of one run; start nodes with :meth:`add_node`, clean up with :meth:`cleanup`."""

    endpoint: str
    root: Path
    nnodes: str = "1:3"
    flags: Sequence[str] = ()
    extra_env: dict[str, str] = field(default_factory=dict)
    torchrun_flags: Sequence[str] = ()
    run_id: str = field(default_factory=lambda: f"job-{uuid.uuid4().hex[:8]}")
    # A rendezvous closes when its job ends; a later job continuing the same run needs a new one.
    rdzv_id: str = ""
    recipe: Path = RECIPE
    nodes: list[Node] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rdzv_id = self.rdzv_id or self.run_id

    @property
    def run_dir(self) -> Path:
        return self.root / self.run_id

    def command(self, torchrun_flags: Sequence[str] = (), flags: Sequence[str] = ()) -> list[str]:
        return [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={self.nnodes}", "--nproc-per-node=1", "--max-restarts=3", "--monitor-interval=0.1",
            "--rdzv-backend=etcd", f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.rdzv_id}", TEST_RDZV_CONF,
            *self.torchrun_flags, *torchrun_flags,
            str(self.recipe), f"--run.root={self.root}", f"--run.name={self.run_id}",
            *(TINY if self.recipe == RECIPE else TINY_CLASSIFIER), *self.flags, *flags,
        ]  # fmt: skip

    def add_node(
        self, command_prefix: Sequence[str] = (), extra_env: dict[str, str] | None = None,
        torchrun_flags: Sequence[str] = (), cwd: Path | None = None, flags: Sequence[str] = (),
    ) -> Node:
        """Start one more agent; ``command_prefix`` (e.g. ``ip netns exec NS``), ``extra_env``,
        ``torchrun_flags``, ``cwd`` (a directory of its own: a machine with its own disk) and
        ``flags`` (the script's settings, e.g. a ``--checkpoint.memory_dir`` of its own: a machine
        with its own memory) apply to this node only."""
        index = len(self.nodes)
        command = [*command_prefix, *self.command(torchrun_flags, flags)]
        node = start_node(
            command, env(**self.extra_env, **(extra_env or {})), self.root / f"{self.rdzv_id}-node{index}.log", cwd=cwd
        )  # fmt: skip
        self.nodes.append(node)
        return node

    def output(self) -> str:
        return "\n".join(node.output() for node in self.nodes)

    def progress(self) -> list[tuple[int, int]]:
        """(step, world size) lines of whichever node hosts rank 0, in log order per node."""
        return [pair for node in self.nodes for pair in steps(node.output())]

    def last_step(self) -> int:
        seen = self.progress()
        return max((s for s, _ in seen), default=0)

    def wait_until(self, predicate, timeout: float, what: str):
        try:
            return wait_for(predicate, timeout, what=what)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n--- job output ---\n{self.output()[-6000:]}") from None

    def wait_for_step(self, step: int, timeout: float = 180, world_size: int | None = None) -> None:
        self.wait_until(
            lambda: any(s >= step and (world_size is None or w == world_size) for s, w in self.progress()),
            timeout, f"step {step}" + (f" at world size {world_size}" if world_size else ""),
        )  # fmt: skip

    def wait_for_commit(self, step: int | None = None, timeout: float = 60) -> None:
        """Wait until a checkpoint (of ``step``, default any) is committed: a node killed while its
        asynchronous save is in flight would otherwise leave nothing to resume from."""
        needle = "Checkpoint committed at " + (f"{self.run_dir / 'checkpoints' / f'step-{step:09d}'}:" if step else "")
        what = f"the commit of step {step}" if step else "a committed checkpoint"
        self.wait_until(lambda: needle in self.output(), timeout, what)

    def worker_starts(self) -> list[dict]:
        """Every worker start on record, oldest first: the header each worker wrote to the step ledger
        (``--data.ledger=true``; elastic_ddp/data/ledger.py), with its attempt, world size, rank and
        its agent's torchrun restart count (``restart``)."""
        headers = []
        for path in sorted((self.run_dir / LEDGER_DIR).glob("rank-*.jsonl")):
            complete = path.read_text().split("\n")[:-1]  # a line being written is not read yet
            headers += [json.loads(line) for line in complete if line.startswith('{"attempt"')]
        return sorted(headers, key=lambda header: header["time"])

    def restarts(self) -> int:
        """The most torchrun restarts any agent of the job has spent (failures; membership changes
        spend none), from the workers' ledger headers."""
        starts = self.worker_starts()
        assert starts, f"no worker start on record under {self.run_dir / LEDGER_DIR} (is --data.ledger=true set?)"
        return max(start["restart"] for start in starts)

    def mark(self) -> list[int]:
        """A position in every node's output; :meth:`output_since` returns what came after it."""
        return [len(node.output()) for node in self.nodes]

    def output_since(self, mark: list[int]) -> str:
        return "\n".join(node.output()[mark[i] if i < len(mark) else 0 :] for i, node in enumerate(self.nodes))

    def wait_for_training_since(self, mark: list[int], t0: float, world_size: int, timeout: float = 180) -> float:
        """Seconds from ``t0`` (monotonic) until, after ``mark``, the workers resumed from a checkpoint
        and logged a step at ``world_size``."""

        def trained_after_resume() -> bool:
            for node, start in zip(self.nodes, [*mark, *[0] * len(self.nodes)]):
                text = node.output()[start:]
                resumed = list(RESUMED_LINE.finditer(text))
                if resumed and any(w == world_size for _, w in steps(text[resumed[-1].end() :])):
                    return True
            return False

        self.wait_until(trained_after_resume, timeout, f"a resume and training at world size {world_size}")
        return time.monotonic() - t0

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()

    def finish(self, nodes: Sequence[Node] | None = None, timeout: float = 240) -> str:
        """Wait for ``nodes`` (default: every node) to exit, clean up, and return the job's output;
        the test fails, showing the output's end, unless every one of them exited 0."""
        try:
            codes = [node.wait(timeout=timeout) for node in (self.nodes if nodes is None else nodes)]
        finally:
            self.cleanup()
        output = self.output()
        assert codes == [0] * len(codes), output[-6000:]
        return output

    def stop_and_verify_checkpoints(self, url: str | None = None, *, require_any: bool = True) -> int:
        """Kill every node (mid-save, perhaps), then check that every committed checkpoint of the run
        (under ``url``, default the run's own directory) is intact; return how many there are.

        This is what "no data lost" means in the reliability report: whatever a failure interrupted,
        nothing that was committed is damaged or missing its files. ``require_any=False`` where the
        scenario may end before its first asynchronous save commits."""
        self.cleanup()
        storage = Storage(url or str(self.run_dir / "checkpoints"))
        infos = list_checkpoints(storage)
        damaged = [
            f"{info.url}: {result.bad_file} ({result.reason})"
            for info in infos
            if not (result := verify_checkpoint(storage, info)).ok
        ]
        assert infos or not require_any, f"no committed checkpoint under {storage.url}"
        assert not damaged, "damaged committed checkpoints:\n" + "\n".join(damaged)
        return len(infos)


def one_node_job(
    endpoint: str, root: Path, run_id: str, *, nproc: int, attempt: str, recipe: Path = RECIPE,
    flags: Sequence[str] = (), extra_env: dict[str, str] | None = None,
) -> Job:
    """One agent with ``nproc`` workers on the run ``run_id``, started: each ``attempt`` of a run is
    a launch of its own (a rendezvous of its own), as a job submitted again would be."""
    job = Job(
        endpoint, root, nnodes="1", run_id=run_id, rdzv_id=f"{run_id}-{attempt}-{uuid.uuid4().hex[:6]}", recipe=recipe,
        flags=flags, torchrun_flags=[f"--nproc-per-node={nproc}"], extra_env=extra_env or {},
    )  # fmt: skip
    job.add_node()
    return job


def report(
    scenario: str, behaviour: str, recovery_s: float | None, steps_lost: int | None, *, checkpoints_verified: int, **more
) -> None:
    """Print (and append to ``$ELASTIC_DDP_RELIABILITY_OUT``) one scenario's measured figures.

    ``checkpoints_verified`` comes from :meth:`Job.stop_and_verify_checkpoints`, which fails the
    test if any committed checkpoint is damaged: a report exists only when no data was lost."""
    record = {
        "scenario": scenario, "behaviour": behaviour, "recovery_s": recovery_s, "steps_lost": steps_lost,
        "checkpoints_verified": checkpoints_verified, "data_lost": "none", **more,
    }  # fmt: skip
    line = json.dumps(record)
    print(f"RELIABILITY {line}")
    out = os.environ.get(ENV_RELIABILITY_OUT)
    if out:
        with open(out, "a", encoding="utf-8") as file:
            file.write(line + "\n")
