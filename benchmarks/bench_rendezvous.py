"""Rendezvous: time to form a group of N agents with etcd-v3 (this package) vs torch's c10d and etcd-v2.

N torchrun agents on this machine (``--nnodes=N --nproc-per-node=1``), each running
benchmarks/workers/rdzv_probe.py, which prints the wall-clock time right after
``init_process_group``. Measured: from the first agent's start to the last worker's line (the
whole group formed), so agent and worker start-up are in every variant alike. All variants get the
same ``--rdzv-conf`` timeouts. etcd runs once with ``--enable-v2`` and serves both etcd variants;
torch's ``etcd-v2`` needs the ``python-etcd`` client, and is left out (noted) without it.
"""

from __future__ import annotations

import importlib.util
import re
import uuid

from benchmarks.common import WORKERS, Context, Result, Target, TimedProcess, alternate, child_env, ratios, row, torchrun
from elastic_ddp.tools.etcd_server import EtcdServer, free_port

NAME = "rendezvous"
TITLE = "Rendezvous: time to form a group, etcd-v3 vs torch c10d vs torch etcd-v2"

PROBE = WORKERS / "rdzv_probe.py"
READY = re.compile(r"RDZV_PROBE ready_wall=([\d.]+)")
# torchrun's own INFO lines (LOGLEVEL=INFO) around the rendezvous proper.
RDZV_BEGIN = re.compile(r"Rendezvous'ing worker group")
RDZV_DONE = re.compile(r"Rendezvous complete for workers")
RDZV_CONF = "join_timeout=120,last_call_timeout=2,close_timeout=10"


def form_group(backend: str, endpoint: str, n: int, log_dir) -> dict[str, float]:
    """``total_s``: from the first agent's start until all ``n`` workers have their process group;
    ``rdzv_s``: from the first agent entering the rendezvous until the last one leaves it."""
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    cmd = torchrun(
        f"--nnodes={n}", "--nproc-per-node=1", "--max-restarts=0", "--monitor-interval=0.1",
        f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
        f"--rdzv-conf={RDZV_CONF}", script=PROBE,
    )  # fmt: skip
    env = child_env(LOGLEVEL="INFO")
    agents = [TimedProcess(cmd, env, log_dir / f"{backend}-{n}-{i}.log") for i in range(n)]
    try:
        ready = [agent.wait_for(READY.search, timeout=180, what=f"{backend} worker ready")[0] for agent in agents]
        for agent in agents:
            agent.check(60)
        begin = min(agent.wait_for(RDZV_BEGIN.search, timeout=1)[0] for agent in agents)
        done = max(agent.wait_for(RDZV_DONE.search, timeout=1)[0] for agent in agents)
        return {"total_s": max(ready) - agents[0].started, "rdzv_s": done - begin}
    finally:
        for agent in agents:
            agent.cleanup()


def run(ctx: Context) -> Result:
    sizes = [2] if ctx.smoke else [2, 4, 8]
    have_v2 = importlib.util.find_spec("etcd") is not None  # python-etcd, torch's v2 client
    backends = ["etcd-v3", "c10d"] + (["etcd-v2"] if have_v2 else [])
    log_dir = ctx.scratch(f"{NAME}/logs")
    result = Result(NAME, TITLE, params={"sizes": sizes, "rdzv_conf": RDZV_CONF, "repeats": ctx.repeats})
    if not have_v2:
        result.notes.append("torch's etcd-v2 was not measured: its client `python-etcd` is not installed.")
    with EtcdServer(ctx.scratch(f"{NAME}/etcd"), enable_v2=True) as etcd:

        def variant(backend: str, n: int):
            def once(i: int) -> dict[str, float]:
                endpoint = f"127.0.0.1:{free_port()}" if backend == "c10d" else etcd.endpoint
                return form_group(backend, endpoint, n, log_dir)

            return once

        for n in sizes:
            # 8 agents on 2 cores take long: fewer repeats for the largest group keep the run under 15 min.
            repeats = ctx.repeats if n < 8 else max(1, ctx.repeats - 1)
            samples = alternate({b: variant(b, n) for b in backends}, repeats)
            result.samples[f"n{n}"] = samples
            for backend in backends:
                result.rows.append(row(f"{n} agents: {backend}, start to all workers ready", samples[backend]["total_s"], "s"))
                result.rows.append(row(f"{n} agents: {backend}, rendezvous only", samples[backend]["rdzv_s"], "s"))
            for metric, what in (("total_s", "start to ready"), ("rdzv_s", "rendezvous only")):
                v3 = samples["etcd-v3"][metric]
                result.rows.append(row(f"{n} agents: etcd-v3 / c10d, {what}", ratios(v3, samples["c10d"][metric]),
                                       "ratio", Target("<=", 1.0, "≤ 1 (no slower)")))
                if have_v2:
                    result.rows.append(row(f"{n} agents: etcd-v3 / etcd-v2, {what}",
                                           ratios(v3, samples["etcd-v2"][metric]), "ratio"))
    result.notes.append(
        "'start to ready' includes starting N torchrun agents and N workers (Python + torch import) on "
        "this machine's shared cores; 'rendezvous only' is the span between torchrun's own log lines "
        "\"Rendezvous'ing worker group\" (first agent) and \"Rendezvous complete\" (last agent)."
    )
    return result
