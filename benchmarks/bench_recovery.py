"""Recovery after a node kill: this framework's defaults vs its former rendezvous vs stock torchrun.

Two torchrun agents ("nodes") on this machine, ``--nnodes=1:2 --nproc-per-node=1
--max-restarts=3``, training until both are at world size 2 and past step ``warm``; then the
second node is killed with all its processes (tests.helpers.nodes semantics).

* ``ours``: recipes/train.py, ``--rdzv-backend=etcd`` (this package's per-node etcd rendezvous
  and its recovery defaults), async checkpoints every N steps, resume ``auto``.
* ``blob``: the same recipe on the rendezvous handler this package shipped before (the whole
  membership in one etcd key, heartbeats compared across hosts; benchmarks/workers/blob_handler.py,
  ``--rdzv-backend=etcd-blob`` through benchmarks/workers/torchrun_blob.py).
* ``stock``: benchmarks/workers/plain_ddp.py, ``--rdzv-backend=c10d`` with torch's default
  settings, a ``torch.save`` checkpoint from rank 0 every N steps that a restart resumes from. The
  first node starts alone until c10d's store port is open, so it hosts the store (the survivor
  then is the store host; killing the host instead loses the whole job, see docs/rendezvous.md).

Measured on the survivor: seconds from the kill to its first step line at world size 1, and the
steps lost (the newest step rank 0 printed before the kill minus the step resumed from; -1 when the
survivor completed one more step with the victim's gradients and kept it). For ``ours``
the recovery is cut into its phases by the survivor's own log lines, stamped as they arrive
(:data:`PHASES`): detection (the agent asks for a new round), round formation, worker start
(interpreter, imports, process group), resume (the tiers surveyed and the state restored) and the
first step.

Then (``ours`` only) a third node joins the survivor: seconds from its start to the first step at
world size 2, the all-rank stall (the last step at world size 1 to the first at 2) and the steps
the join lost. Each node of ``ours`` has a memory directory of its own, as machines would.

``compiled`` is ``ours`` with ``--train.compile=true``, alternated with it, as a compiled job is
deployed: each node has an inductor cache directory of its own (``TORCHINDUCTOR_CACHE_DIR``,
node-local and outliving the workers, as torch's default under /tmp is), new for each repeat, so the
first start compiles cold and the survivor's restart compiles from its node's cache;
``--train.micro_batch_size=4`` keeps a rank's batches at 4 samples at world size 1 and 2 (a new shape
would be a new graph: compiled anew); the checkpoints are signed (``ELASTIC_DDP_CHECKPOINT_KEY``), so
the joining node (a new machine) loads the compile artifacts rank 0 published
(elastic_ddp/checkpoint/compiled.py) -- on CPUs inductor's C++ kernels are not among them and still
compile there.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from benchmarks.common import (
    RECIPE, STEP_LINE, WORKERS, WORLD_SIZE, Context, Result, Target, TimedProcess, alternate, child_env, ratios, row,
    step_stamps, summary, torchrun,
)  # fmt: skip
from benchmarks.loops import PLAIN_LOOP, TINY, recipe_flags
from elastic_ddp.tools.etcd_server import EtcdServer, free_port
from elastic_ddp.contract import AGENT_DIR_PREFIX, ENV_CHECKPOINT_KEY, WARM_SUFFIX

NAME = "recovery"
TITLE = "Recovery after a node kill: per-node etcd rendezvous vs the blob handler vs stock torchrun c10d"

CKPT_EVERY = 10

# Each phase ends at the survivor's first line (after the kill) that matches; in this order.
PHASES = (
    ("detection", re.compile(r"attempts to join the next round")),
    ("round formation", re.compile(r"has joined round \d+ of the rendezvous")),
    ("worker start", re.compile(r"Rank 0 of world size 1 on")),
    ("resume", re.compile(r"Resumed from|Restored from")),
    ("first step", re.compile(r"\[rank0\] step=\d+/\d+ .*world_size=1\b")),
)
# The worker's own account of its start (elastic_ddp.worker.distributed.init_distributed).
WORKER_READY = re.compile(r"ready ([\d.]+) s after its process started \(process group ([\d.]+) s\)")
MAX_STEPS = 1_000_000  # killed long before
# Steps the survivor trains alone before a new node joins it.
JOIN_AFTER_STEPS = 10


def _agent(backend: str, endpoint: str, run_id: str, script: Path, args: list[str]) -> list[str]:
    command = torchrun(
        "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=3",
        f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
        script=script, script_args=args,
    )  # fmt: skip
    if backend == "etcd-blob":  # torchrun itself, with the baseline handler registered first
        command[1:3] = [str(WORKERS / "torchrun_blob.py")]
    return command


def _step_at_world(line: str, world: int) -> int | None:
    match = STEP_LINE.search(line)
    ws = WORLD_SIZE.search(line)
    return int(match[1]) if match and ws and int(ws[1]) == world else None


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def phases(lines: list[tuple[float, str]], killed_at: float) -> dict[str, float]:
    """Seconds each of :data:`PHASES` took on the survivor (phases whose line is missing are left out)."""
    durations, start = {}, killed_at
    for name, pattern in PHASES:
        stamp, line = next(((t, line) for t, line in lines if t > start and pattern.search(line)), (None, ""))
        if stamp is None:
            continue
        durations[f"phase: {name}"] = stamp - start
        start = stamp
        ready = WORKER_READY.search(line)
        if ready:  # the worker start, split by the worker's own clock
            age, group = float(ready[1]), float(ready[2])
            durations["phase: worker start: interpreter, imports, settings"] = age - group
            durations["phase: worker start: process group"] = group
    return durations


def kill_and_recover(
    cmd: list[str], log_dir: Path, warm: int, store_port: int | None = None, join: bool = False,
    machine: Callable[[int], list[str]] = lambda node: [], machine_env: Callable[[int], dict[str, str]] = lambda node: {},
) -> dict[str, float]:
    """``machine(i)``: the script's settings of node ``i`` only (its own memory directory: a machine of
    its own); ``machine_env(i)``: its environment's own variables (its own inductor cache; a ``TMPDIR``
    of its own, where the kill then also waits for the node's warm template: a restart in the
    steady state, not in a job's first seconds)."""
    nodes = [TimedProcess([*cmd, *machine(0)], child_env(**machine_env(0)), log_dir / "node0.log")]
    try:
        if store_port is not None:
            deadline = time.monotonic() + 60
            while not _port_open(store_port):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"The first agent did not open the c10d store port {store_port}.")
                time.sleep(0.1)
        nodes.append(TimedProcess([*cmd, *machine(1)], child_env(**machine_env(1)), log_dir / "node1.log"))
        survivor, victim = nodes

        def warmed(line: str):
            step = _step_at_world(line, 2)
            return step is not None and step >= warm

        def templates_warm() -> bool:
            dirs = [machine_env(i).get("TMPDIR") for i in range(len(nodes))]
            return all(d is None or any(Path(d).glob(f"{AGENT_DIR_PREFIX}*/*{WARM_SUFFIX}")) for d in dirs)

        # Rank 0 prints; it may live on either node.
        deadline = time.monotonic() + 240
        while not (any(any(warmed(l) for _, l in n.lines()) for n in nodes) and templates_warm()):
            if time.monotonic() > deadline or not all(n.running for n in nodes):
                raise RuntimeError(f"No step {warm} at world size 2.\n{survivor.output()[-3000:]}")
            time.sleep(0.1)
        killed_at = time.monotonic()
        victim.kill()
        before = [s for n in nodes for s, t in step_stamps(n.lines()).items() if t <= killed_at]
        stamp, first = survivor.wait_for(lambda l: _step_at_world(l, 1), timeout=240, after=killed_at,
                                         what="the survivor's first step at world size 1")
        measured = {"recovery_s": stamp - killed_at, "steps_lost": max(before) - (first - 1),
                    "last_step_before_kill": max(before), "first_step_after": first,
                    **phases(survivor.lines(), killed_at)}
        if join:
            measured.update(join_and_resume([*cmd, *machine(2)], child_env(**machine_env(2)), log_dir, survivor, nodes, first))
        return measured
    finally:
        for node in nodes:
            node.cleanup()
        for i in range(len(nodes)):
            temp = machine_env(i).get("TMPDIR")
            if temp:
                shutil.rmtree(temp, ignore_errors=True)


def _machine_tmp(root: Path, node: int, backend: str) -> dict[str, str]:
    """A ``TMPDIR`` of the node's own under this package's rendezvous (whose agent starts a template
    there); none for the others. A short path beside the scratch directory's, named after it (a deep
    one would put the agent's directory in /tmp: elastic_ddp/rendezvous/agent_dir.py)."""
    if backend != "etcd":
        return {}
    link = root / f"tmp-node{node}"
    if not link.exists():
        link.symlink_to(tempfile.mkdtemp(prefix="edp-bench-", dir="/tmp"))
    return {"TMPDIR": os.path.realpath(link)}


def join_and_resume(cmd: list[str], env: dict[str, str], log_dir: Path, survivor: TimedProcess,
                    nodes: list[TimedProcess], first: int) -> dict[str, float]:
    """A new node joins the survivor: seconds from its start to the first step at world size 2, the
    all-rank stall (the last step at world size 1 to the first at 2), the steps the join lost (0 when
    the stop's state is what the new round resumes from) and whether that state came from memory."""
    survivor.wait_for(lambda l: (s := _step_at_world(l, 1)) is not None and s >= first + JOIN_AFTER_STEPS or None,
                      timeout=240, what=f"step {first + JOIN_AFTER_STEPS} at world size 1")
    joined_at = time.monotonic()
    newcomer = TimedProcess(cmd, env, log_dir / "node2.log")
    nodes.append(newcomer)
    deadline = joined_at + 240
    while True:  # rank 0 prints the steps, and the newcomer may be rank 0 of the new round
        lines = sorted(line for node in (survivor, newcomer) for line in node.lines())
        pair = next(((t, s) for t, l in lines if t > joined_at and (s := _step_at_world(l, 2)) is not None), None)
        if pair is not None:
            break
        if time.monotonic() > deadline or not survivor.running:
            raise RuntimeError(f"No step at world size 2 after the join.\n{survivor.output()[-3000:]}")
        time.sleep(0.1)
    stamp, resumed = pair
    alone = {s: t for t, l in lines if (s := _step_at_world(l, 1)) is not None and t < stamp}
    last_alone = max(alone)
    return {"join_s": stamp - joined_at, "join_stall_s": stamp - alone[last_alone],
            "join_steps_lost": last_alone - (resumed - 1),
            "join_from_memory": 1.0 if any(t > joined_at and "Restored from node" in l for t, l in lines) else 0.0}


def run(ctx: Context) -> Result:
    warm = 15 if ctx.smoke else 25
    with_stock = not ctx.smoke
    result = Result(NAME, TITLE, params={"warm_steps": warm, "ckpt_every": CKPT_EVERY, "stock_measured": with_stock,
                                         "repeats": min(ctx.repeats, 2), "workload": TINY.__dict__})
    if not with_stock:
        result.notes.append("Smoke run: only this framework's recovery was measured (stock torchrun takes ~46 s).")
    result.notes.append(
        "The survivors' workers fail at once on the dead peer's closed sockets; with the per-node rendezvous the "
        "survivors register for a new round the dead node never joins, and the node that called the round probes "
        "the dead node's agent: its port refuses the connection, so the round completes without waiting for its "
        "lease or the last call. The blob handler instead waited for the dead node's heartbeat to be 3 s old "
        "before reopening the round."
    )
    with EtcdServer(ctx.scratch(f"{NAME}/etcd")) as etcd:

        def recipe(backend: str, tag: str, *extra: str, env: dict[str, str] | None = None):
            def once(i: int) -> dict[str, float]:
                root = ctx.scratch(f"{NAME}/{tag}{i}")
                run_id = f"recovery-{uuid.uuid4().hex[:8]}"
                args = [*recipe_flags(TINY, root, MAX_STEPS, 1, CKPT_EVERY), "--checkpoint.resume=auto",
                        f"--run.name={run_id}", *extra]  # fmt: skip
                return kill_and_recover(_agent(backend, etcd.endpoint, run_id, RECIPE, args), root, warm,
                                        join=backend == "etcd",
                                        machine=lambda node: [f"--checkpoint.memory_dir={root}/shm-node{node}"],
                                        machine_env=lambda node: {"TORCHINDUCTOR_CACHE_DIR": f"{root}/inductor-node{node}",
                                                                  **_machine_tmp(root, node, backend), **(env or {})})  # fmt: skip

            return once

        def stock(i: int) -> dict[str, float]:
            root = ctx.scratch(f"{NAME}/stock{i}")
            port = free_port()
            args = [*TINY.plain_flags(), f"--steps={MAX_STEPS}", "--log-every=1",
                    f"--ckpt-every={CKPT_EVERY}", f"--ckpt-path={root}/ckpt.pt"]
            cmd = _agent("c10d", f"127.0.0.1:{port}", f"stock-{uuid.uuid4().hex[:8]}", PLAIN_LOOP, args)
            return kill_and_recover(cmd, root, warm, store_port=port)

        variants = {
            "ours": recipe("etcd", "ours"),
            **({"compiled": recipe("etcd", "compiled", "--train.compile=true", "--train.micro_batch_size=4",
                                   env={ENV_CHECKPOINT_KEY: "benchmark-key"}),
                "blob": recipe("etcd-blob", "blob"),
                "stock": stock} if with_stock else {}),
        }  # fmt: skip
        samples = alternate(variants, min(ctx.repeats, 2))
    result.samples = samples
    result.rows = [
        row("ours: kill to first step on the survivor", samples["ours"]["recovery_s"], "s", Target("<=", 2.5)),
        *(row(f"ours: {name}", samples["ours"][name], "s") for name in samples["ours"] if name.startswith("phase: ")),
        row("ours: steps lost", samples["ours"]["steps_lost"], "steps"),
        row("ours: a node joins: its start to the first step at the new size", samples["ours"]["join_s"], "s"),
        row("ours: a node joins: all-rank stall", samples["ours"]["join_stall_s"], "s", Target("<=", 2.5)),
        row("ours: a node joins: steps lost", samples["ours"]["join_steps_lost"], "steps", Target("<=", 0)),
        row("ours: a node joins: resumed from node memory", samples["ours"]["join_from_memory"], "1 = yes"),
    ]
    if with_stock:
        compiled = samples["compiled"]
        result.rows += [
            row("compiled: kill to first step on the survivor", compiled["recovery_s"], "s"),
            *(row(f"compiled: {name}", compiled[name], "s") for name in compiled if name.startswith("phase: ")),
            row("compiled / ours: kill to first step", ratios(compiled["recovery_s"], samples["ours"]["recovery_s"]),
                "ratio", Target("<=", 3.0, "≤ 3×")),
            row("compiled: steps lost", compiled["steps_lost"], "steps", Target("<=", 1)),
            row("compiled: a node joins (loads the artifacts; C++ kernels compile): its start to the first step at the new size",
                compiled["join_s"], "s"),
            row("compiled: a node joins: all-rank stall", compiled["join_stall_s"], "s"),
        ]  # fmt: skip
        speedup = ratios(samples["stock"]["recovery_s"], samples["ours"]["recovery_s"])
        result.rows += [
            row("blob handler: kill to first step on the survivor", samples["blob"]["recovery_s"], "s"),
            row("ours / blob handler", ratios(samples["ours"]["recovery_s"], samples["blob"]["recovery_s"]), "ratio",
                Target("<=", 1.1, "≤ 1.1 (as fast)")),
        ]  # fmt: skip
        result.rows += [
            row("stock: kill to first step on the survivor", samples["stock"]["recovery_s"], "s"),
            row("stock: steps lost", samples["stock"]["steps_lost"], "steps"),
            row("speed-up: stock / ours", speedup, "ratio", Target(">=", 15.0, "≥ 15×")),
        ]
    lost = summary(samples["ours"]["steps_lost"])["median"]
    result.notes.append(f"Checkpoints every {CKPT_EVERY} steps in both; the recipe saves asynchronously (a save of step N "
                        f"commits while N+1.. train), so up to {2 * CKPT_EVERY} steps lost is expected "
                        f"(median here: {lost}). Recipe resumes only from committed, verified checkpoints.")
    return result
