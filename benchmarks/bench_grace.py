"""Grace: the time torchrun really gives a worker between SIGTERM and SIGKILL.

A worker's stop checkpoint (finish the in-flight async save, then a blocking save of the step it
stopped at) must fit in that time. Real torchrun agents (``--rdzv-backend=etcd``, this package)
run this very file as their worker: it ignores SIGTERM, notes when each one came, and writes a
heartbeat every 50 ms to a file of its own until SIGKILL ends it (or its agent vanishes, as the
recipe's orphan watch would). Grace = last heartbeat - first SIGTERM (50 ms resolution).

Variants:

* ``restart``: a membership change. Two agents run (``--nnodes=2:3``); a third joins, and the
  two stop their workers to re-rendezvous at three. torch's ``LocalElasticAgent._stop_workers``
  calls ``_shutdown()`` with its 30 s default there; ``--shutdown-timeout`` (given, 5 s) is not
  consulted. The same path stops the survivors' workers when a node leaves.
* ``agent``: the agent itself gets SIGTERM (preemption, kubelet, scancel), once, with neither
  ``--shutdown-timeout`` nor ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (``default``) or with
  ``--shutdown-timeout`` given.
* ``agent, twice``: SIGTERM to the agent, and again 100 ms later (on Slurm preemption the agent
  can be signalled by Slurm and by a forwarding batch script): does the second one cut the grace?

Run it under each torch of the declared range: ``venv/bin/python benchmarks/run.py --only grace``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

if __package__ in (None, ""):  # run by torchrun as the worker script
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NAME = "grace"
TITLE = "Grace: seconds torchrun gives a worker between SIGTERM and SIGKILL"

READY = "GRACE_WORKER ready"
_BEAT_S = 0.05
_WORKER_MAX_S = 300.0  # a worker nobody kills gives up: no benchmark leaves processes behind


# --------------------------------------------------------------------------------------- worker
# The worker imports only the standard library (so it starts fast); the benchmark half below
# imports the benchmark plumbing, elastic_ddp and torch inside its functions.


def _worker(out_dir: Path, measured_world_size: int) -> None:
    """Heartbeat into ``out_dir`` while ignoring SIGTERM; exit at once outside the measured group."""
    if int(os.environ["WORLD_SIZE"]) != measured_world_size:
        return  # the group formed after a membership change only ends the job
    terms: list[float] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: terms.append(time.time()))
    agent = os.getppid()
    path = out_dir / f"worker-{os.environ['RANK']}-{os.getpid()}.jsonl"
    print(f"{READY} rank={os.environ['RANK']}", flush=True)
    deadline = time.monotonic() + _WORKER_MAX_S
    with open(path, "a", buffering=1) as beats:
        while time.monotonic() < deadline:
            orphaned = os.getppid() != agent
            beats.write(json.dumps({"t": time.time(), "terms": terms, "orphaned": orphaned}) + "\n")
            if orphaned:
                return
            time.sleep(_BEAT_S)


def _last_beats(out_dir: Path) -> list[dict]:
    beats = []
    for path in sorted(out_dir.glob("worker-*.jsonl")):
        lines = path.read_text().splitlines()
        if lines:
            beats.append(json.loads(lines[-1]))
    return beats


# ------------------------------------------------------------------------------------ benchmark


def _wait_ready(agents, workers: int, timeout: float = 180.0) -> None:
    def ready() -> int:  # workers share the agent's output, so two lines can run together
        return sum(line.count(READY) for agent in agents for _, line in agent.lines())

    deadline = time.monotonic() + timeout
    while ready() < workers:
        if time.monotonic() > deadline or not all(agent.running for agent in agents):
            raise RuntimeError(f"{ready()} of {workers} workers started; agent output:\n{agents[0].output()[-3000:]}")
        time.sleep(0.1)  # poll interval, bounded by the deadline


def _measure(ctx, endpoint: str, variant: str, shutdown_timeout: int | None, repeat: int) -> dict[str, float]:
    from benchmarks.common import TimedProcess, child_env, torchrun

    scratch = ctx.scratch(f"{NAME}/{variant.replace(' ', '_').replace(',', '')}-{repeat}")
    env = child_env()
    env.pop("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", None)
    timeout_flag = [] if shutdown_timeout is None else [f"--shutdown-timeout={shutdown_timeout}"]
    run_id = f"grace-{uuid.uuid4().hex[:8]}"
    restart = variant == "restart"
    nnodes, world = ("2:3", 2) if restart else ("1:1", 2)
    nproc = "1" if restart else "2"

    def agent_cmd() -> list[str]:
        return torchrun(
            f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", "--max-restarts=0", "--monitor-interval=0.2",
            "--rdzv-backend=etcd", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}", *timeout_flag,
            "--rdzv-conf=first_round_timeout=2",  # the first two start together; the third joins later
            script=Path(__file__), script_args=[str(scratch), str(world)],
        )  # fmt: skip

    agents = [TimedProcess(agent_cmd(), env, scratch / f"agent{i}.log") for i in range(2 if restart else 1)]
    try:
        _wait_ready(agents, world)
        signalled = time.time()  # the join, or the first SIGTERM
        if restart:
            agents.append(TimedProcess(agent_cmd(), env, scratch / "agent2.log"))
        else:
            os.kill(agents[0].pid, signal.SIGTERM)
            if variant.endswith("twice"):
                time.sleep(0.1)
                os.kill(agents[0].pid, signal.SIGTERM)
        for agent in agents:
            agent.wait(timeout=240)
        agent_exit_s = time.time() - signalled
    finally:
        for agent in agents:
            agent.cleanup()
    beats = _last_beats(scratch)
    if len(beats) != world or not all(b["terms"] for b in beats):
        raise RuntimeError(f"{variant}: expected {world} workers that got SIGTERM, found {beats}.")
    return {
        "grace_s": min(b["t"] - b["terms"][0] for b in beats),
        "sigterms": max(len(b["terms"]) for b in beats),
        "orphaned": float(any(b["orphaned"] for b in beats)),
        "agent_exit_s": agent_exit_s,
    }


def run(ctx):
    from benchmarks.common import Result, Target, row
    from elastic_ddp.config import CheckpointConfig
    from elastic_ddp.tools.etcd_server import EtcdServer
    import torch

    given = 5 if ctx.smoke else 45
    variants: dict[str, int | None] = {
        "agent, --shutdown-timeout": given,
        "agent, twice, --shutdown-timeout": given,
    }
    if not ctx.smoke:  # each of these waits torch's fixed 30 s
        variants = {"restart": 5, "agent, default": None, **variants}
    grace_default = CheckpointConfig().grace_s
    result = Result(NAME, TITLE, params={"torch": torch.__version__, "shutdown_timeout": given, "repeats": ctx.repeats})
    with EtcdServer(ctx.scratch(f"{NAME}/etcd")) as etcd:
        samples: dict[str, dict[str, list[float]]] = {v: {} for v in variants}
        for repeat in range(ctx.repeats):
            for variant, timeout in variants.items():
                for metric, value in _measure(ctx, etcd.endpoint, variant, timeout, repeat).items():
                    samples[variant].setdefault(metric, []).append(value)
    result.samples = samples
    for variant, timeout in variants.items():
        given_text = "" if timeout is None or variant == "restart" else f"={timeout}"
        label = f"torch {torch.__version__}: {variant}{given_text}"
        result.rows.append(row(f"{label}: SIGTERM to SIGKILL", samples[variant]["grace_s"], "s"))
        result.rows.append(row(f"{label}: SIGTERMs a worker got", samples[variant]["sigterms"], "count"))
        result.rows.append(row(f"{label}: workers orphaned (agent gone first)", samples[variant]["orphaned"], "0/1"))
        result.rows.append(row(f"{label}: agent exit after the signal", samples[variant]["agent_exit_s"], "s"))
    if "restart" in samples:
        margin = [g - grace_default for g in samples["restart"]["grace_s"]]
        result.rows.append(row(
            f"torch {torch.__version__}: restart grace - checkpoint.grace_s default ({grace_default:g} s)", margin, "s",
            Target(">=", 5.0, "≥ 5 s of margin"),
        ))  # fmt: skip
    result.notes.append(
        "Grace is measured on the workers' own clocks: the last 50 ms heartbeat before SIGKILL (or before "
        "the worker noticed its agent was gone) minus the first SIGTERM it received. 'restart' passes "
        "--shutdown-timeout=5 to show that the membership-change path does not use it."
    )
    return result


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), int(sys.argv[2]))
