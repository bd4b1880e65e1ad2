"""Rendezvous idle cost: what N agents sitting in a completed round cost etcd, per-node handler vs blob handler.

N simulated agents (benchmarks/workers/rdzv_agents.py) form one round and then do what a healthy
job's agents do for days: call ``num_nodes_waiting()`` every monitor interval (0.1 s) while
their handler keeps them alive. Read from etcd's ``/metrics`` over the window, on a fresh etcd
per sample: raft entries (``etcd_server_proposals_committed_total``: every write, applied or not,
is one), database file growth (``etcd_mvcc_db_total_size_in_bytes``) and lease renewals (which
are no raft entries). torch's c10d keeps its state in an agent's TCPStore, not in etcd, and is
not measured here.
"""

from __future__ import annotations

import time

from benchmarks.common import Context, Result, Target, alternate, row
from benchmarks.workers.rdzv_agents import AgentSpec, etcd_metrics, join_outcome, process_cpu_s, simulate
from elastic_ddp.tools.etcd_server import EtcdServer

NAME = "rdzv_idle"
TITLE = "Rendezvous idle cost: etcd writes and database growth while N agents sit in a completed round"

PROCESSES = 4
JOIN_TIMEOUT_S = 120
SETTLE_S = 3.0  # after the round formed: the last joins' writes are not idle cost


def idle_once(backend: str, n: int, window_s: float, ctx: Context, tag: str) -> dict[str, float | None]:
    scratch = ctx.scratch(f"{NAME}/{tag}")
    with EtcdServer(scratch / "etcd") as etcd:

        def measure() -> dict[str, float]:
            time.sleep(SETTLE_S)
            start, t0, cpu0 = etcd_metrics(etcd.endpoint), time.monotonic(), process_cpu_s(etcd.process.pid)
            time.sleep(window_s)
            end, seconds = etcd_metrics(etcd.endpoint), time.monotonic() - t0
            cpu = (process_cpu_s(etcd.process.pid) - cpu0) / seconds

            def rate(name: str) -> float:
                return (end[name] - start[name]) / seconds

            entries = rate("etcd_server_proposals_committed_total")
            return {
                "raft_entries_per_s": entries,
                "writes_per_node_per_s": entries / n,
                "db_bytes_per_min": rate("etcd_mvcc_db_total_size_in_bytes") * 60,
                "db_in_use_bytes_per_min": rate("etcd_mvcc_db_total_size_in_use_in_bytes") * 60,
                "lease_renewals_per_s": rate("etcd_debugging_lease_renewed_total"),
                "etcd_cpu_share": cpu,  # cores etcd used, serving renewals and nothing else
                "window_s": seconds,
            }

        spec = AgentSpec(backend, etcd.endpoint, n, join_timeout=JOIN_TIMEOUT_S, log_dir=str(scratch))
        result = simulate(spec, PROCESSES, while_joined=measure)
        if "join_s" not in join_outcome(result, n):
            if backend == "etcd":
                raise RuntimeError(f"{n} agents on {backend} did not form a round; see the logs under {scratch}.")
            return {"formed": 0.0}  # a baseline that forms no round has no idle cost to measure
        measured = ("raft_entries_per_s", "writes_per_node_per_s", "db_bytes_per_min", "db_in_use_bytes_per_min",
                    "lease_renewals_per_s", "etcd_cpu_share", "window_s")  # fmt: skip
        return {"formed": 1.0, "restarts_asked": float(result["waiting_seen"])} | {key: result[key] for key in measured}


def run(ctx: Context) -> Result:
    # The blob handler forms no round of 256 (see rdzv_join): it is measured at the sizes it forms.
    plan = [(8, ("etcd", "etcd-blob"))] if ctx.smoke else [(8, ("etcd", "etcd-blob")), (64, ("etcd", "etcd-blob")), (256, ("etcd",))]
    windows = {8: 3.0} if ctx.smoke else {8: 20.0, 64: 20.0, 256: 60.0}
    result = Result(NAME, TITLE, params={"plan": [[n, list(v)] for n, v in plan], "windows_s": windows,
                                         "monitor_interval_s": 0.1, "processes": PROCESSES, "repeats": 1})  # fmt: skip
    failed: set[str] = set()  # baselines that formed no round: not run at larger sizes
    for n, backends in plan:
        backends = tuple(b for b in backends if b not in failed)
        samples = alternate({b: (lambda i, b=b: idle_once(b, n, windows[n], ctx, f"{b}-{n}")) for b in backends}, 1)
        result.samples[f"n{n}"] = samples
        for backend in backends:
            s = samples[backend]
            if not all(s["formed"]):
                failed.add(backend)
                result.notes.append(f"{n} agents on {backend} formed no round within {JOIN_TIMEOUT_S} s; not measured "
                                    "at this or larger sizes.")  # fmt: skip
                continue
            ours = backend == "etcd"
            big = ours and n >= 256
            result.rows += [
                row(f"{n} agents: {backend}, raft entries per second", s["raft_entries_per_s"], "1/s"),
                row(f"{n} agents: {backend}, writes per node per second", s["writes_per_node_per_s"], "1/(node·s)",
                    Target("<=", 0.1) if big else None),
                row(f"{n} agents: {backend}, database growth per minute", s["db_bytes_per_min"], "bytes",
                    Target("<=", 0.0, "none") if big else None),
                row(f"{n} agents: {backend}, lease renewals per second (no raft entry)", s["lease_renewals_per_s"], "1/s"),
                row(f"{n} agents: {backend}, etcd CPU", s["etcd_cpu_share"], "cores"),
            ]  # fmt: skip
            if any(s["restarts_asked"]):
                result.notes.append(f"{n} agents on {backend}: num_nodes_waiting() asked for a restart "
                                    f"{int(s['restarts_asked'][0])} time(s) while nothing changed.")
    result.notes.append(
        "One sample per size (a window of 20-60 s after the round formed, plus a fresh etcd); the rates are "
        "steady, and the 256-agent window of 60 s is the acceptance window (\"no measurable growth per minute\")."
    )
    return result
