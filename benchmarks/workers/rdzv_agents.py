"""Simulated torchrun agents for the rendezvous benchmarks: many handlers in threads of a few processes.

A simulated agent does with its rendezvous handler what torchrun's agent does, without workers:
it gets the handler from torch's handler registry (``--rdzv-backend=<name>``: this package's
``etcd``, the baseline ``etcd-blob``, torch's ``c10d``), calls ``next_rendezvous()`` at a
common instant, and then, like the agent's monitor loop, calls ``num_nodes_waiting()`` every
``monitor_interval`` seconds until released. Every agent has its own handler and its own etcd
client (its own gRPC connection), as on separate machines; agents are threads spread over a few
processes, so Python's GIL is shared by ~N/processes agents -- which is why the benchmarks also
record the CPU time of etcd and of the agent processes, to say which of the two bounds a result.

:func:`simulate` runs one such job and returns per-agent results; :func:`etcd_metrics` reads the
counters etcd exports at ``/metrics``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_ddp.contract import ENV_PRESTART

__all__ = ["AgentSpec", "etcd_metrics", "process_cpu_s", "simulate"]

BLOB_BACKEND = "etcd-blob"
GRPC_WAIT_SLICE_S = 2.0  # see _agent_process
METRICS = (
    "etcd_server_proposals_committed_total",
    "etcd_mvcc_db_total_size_in_bytes",
    "etcd_mvcc_db_total_size_in_use_in_bytes",
    "etcd_debugging_lease_renewed_total",
    "etcd_mvcc_put_total",
    "etcd_mvcc_txn_total",
    "etcd_mvcc_range_total",
    "etcd_debugging_mvcc_keys_total",
)


def etcd_metrics(endpoint: str) -> dict[str, float]:
    """The counters of :data:`METRICS` from ``http://<endpoint>/metrics``."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in METRICS:
            values[name] = float(value)
    return values


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class AgentSpec:
    """One simulated job: ``nnodes`` agents of run ``run_id`` (min = max = nnodes)."""

    backend: str
    endpoint: str
    nnodes: int
    join_timeout: int
    conf: dict[str, str] = field(default_factory=dict)
    monitor_interval: float = 0.1
    run_id: str = field(default_factory=lambda: f"sim-{uuid.uuid4().hex[:8]}")
    log_dir: str = ""


def _agent_process(spec: AgentSpec, first: int, count: int, ready, results, go, release, start_at) -> None:
    """One process of ``count`` agents: create their handlers, join at ``start_at``, poll until released."""
    if spec.log_dir:  # the agents' own log lines go to a file, as each node's would
        log = open(Path(spec.log_dir) / f"agents-{first:04d}.log", "a")  # noqa: SIM115 - lives as long as the process
        os.dup2(log.fileno(), 2)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    if spec.backend == BLOB_BACKEND:
        import blob_handler

        blob_handler.register(BLOB_BACKEND)
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # each round's rank 0 publishes its own address
    # A simulated agent starts no workers, so its handler starts no workers' template
    # (elastic_ddp.prestart): hundreds of them, each importing torch, would be the measurement.
    os.environ[ENV_PRESTART] = "0"
    # gRPC's Python client wakes every thread that waits on a stream every 0.1 s, only so that a
    # main thread's signal handlers get to run (grpc._common.MAXIMUM_WAIT_TIMEOUT). An agent on a
    # node of its own has two such threads: negligible. Hundreds of agents in one process on a
    # few cores make that thousands of wake-ups a second, which starve the agents' own lease
    # renewals -- a cost of packing agents together, not of any handler. No agent here is a
    # main thread; a longer slice changes nothing else. The same for every variant.
    import grpc._common

    grpc._common.MAXIMUM_WAIT_TIMEOUT = GRPC_WAIT_SLICE_S
    handlers = []
    for index in range(first, first + count):
        params = RendezvousParameters(
            backend=spec.backend, endpoint=spec.endpoint, run_id=spec.run_id, min_nodes=spec.nnodes,
            max_nodes=spec.nnodes, local_addr=f"node-{index:04d}.rack-{index % 64:02d}.cluster.example.com",
            join_timeout=str(spec.join_timeout), **spec.conf,
        )  # fmt: skip
        handlers.append(get_rendezvous_handler(params))
    ready.put(first)
    go.wait()
    cpu0 = time.process_time()
    out: list[dict[str, Any]] = []
    joined = threading.Barrier(count + 1)
    waiting_seen = [0]

    def agent(handler) -> None:
        time.sleep(max(0.0, start_at.value - time.time()))
        record: dict[str, Any] = {"start": time.time()}
        try:
            info = handler.next_rendezvous()
            record.update(end=time.time(), rank=info.rank, world=info.world_size)
        except Exception as exc:  # noqa: BLE001 - a failed join is a result
            record.update(end=time.time(), error=f"{type(exc).__name__}: {exc}"[:300])
        out.append(record)
        joined.wait()
        if "error" in record:
            return
        while not release.wait(spec.monitor_interval):
            if handler.num_nodes_waiting():
                waiting_seen[0] += 1

    threads = [threading.Thread(target=agent, args=(h,), daemon=True) for h in handlers]
    for thread in threads:
        thread.start()
    joined.wait()
    results.put({"kind": "joined", "records": out, "cpu_s": time.process_time() - cpu0})
    release.wait()
    for thread in threads:
        thread.join(30)
    # Reported before leaving: each departure reaches every member still watching, which on one
    # machine is O(N^2) events (N per node on real nodes) and would make the teardown, not the
    # join, the long part of a sample. simulate() gives the leaving a bounded time.
    results.put({"kind": "released", "waiting_seen": waiting_seen[0]})
    for handler in handlers:
        try:
            handler.shutdown()
        except Exception:  # noqa: BLE001 - leaving is best effort; the next job uses another etcd
            pass


def simulate(
    spec: AgentSpec, processes: int, while_joined: Callable[[], dict[str, float]] | None = None, ready_timeout: float = 600
) -> dict[str, Any]:
    """Run one simulated job; return the agents' records, the join's span and CPU times.

    ``while_joined`` is called once every agent's ``next_rendezvous()`` returned, while they poll
    ``num_nodes_waiting()`` as idle agents do; what it returns is merged into the result.
    """
    ctx = mp.get_context("spawn")
    ready, results = ctx.Queue(), ctx.Queue()
    go, release = ctx.Event(), ctx.Event()
    start_at = ctx.Value("d", 0.0)
    share = [spec.nnodes // processes + (1 if i < spec.nnodes % processes else 0) for i in range(processes)]
    firsts = [sum(share[:i]) for i in range(processes)]
    procs = [
        ctx.Process(target=_agent_process, args=(spec, firsts[i], share[i], ready, results, go, release, start_at), daemon=True)
        for i in range(processes)
        if share[i]
    ]
    for proc in procs:
        proc.start()
    try:
        for _ in procs:
            ready.get(timeout=ready_timeout)
        start_at.value = time.time() + 1.0  # every agent waits for the same instant
        go.set()
        records, cpu = [], 0.0
        for _ in procs:
            message = results.get(timeout=spec.join_timeout + 120)
            records += message["records"]
            cpu += message["cpu_s"]
        result: dict[str, Any] = {"records": records, "agents_cpu_s": cpu, "start_at": start_at.value}
        if while_joined is not None:
            result.update(while_joined())
        release.set()
        result["waiting_seen"] = sum(results.get(timeout=120)["waiting_seen"] for _ in procs)
        return result
    finally:
        release.set()
        go.set()
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def join_outcome(result: dict[str, Any], nnodes: int) -> dict[str, float]:
    """How many agents failed, and the completion time of the join (``join_s``, present only when
    all ``nnodes`` agents formed one correct round: world size ``nnodes``, ranks 0..nnodes-1 once)."""
    records = result["records"]
    failed = [r for r in records if "error" in r]
    ok = (
        len(records) == nnodes
        and not failed
        and sorted(r["rank"] for r in records) == list(range(nnodes))
        and {r["world"] for r in records} == {nnodes}
    )
    outcome = {"failed_agents": float(len(failed))}
    if ok:
        outcome["join_s"] = max(r["end"] for r in records) - result["start_at"]
    return outcome
