"""Rendezvous at scale: N simulated agents joining one round at once, through torch's handler registry.

Side by side: this package's handler (``--rdzv-backend=etcd``: per-node keys under leases), the
handler it replaced (``etcd-blob``: torch's ``DynamicRendezvousHandler``, the whole membership in
one compare-and-set key; see benchmarks/workers/blob_handler.py) and torch's ``c10d`` (the same
handler on a TCPStore that one agent -- here the benchmark process -- hosts). Agents are threads
over a few processes (benchmarks/workers/rdzv_agents.py), every one with its own client; min =
max = N nodes, so the round completes as soon as all registered (no last call). Measured: from
the common start instant until the last agent's ``next_rendezvous()`` returned a correct round
(world size N, ranks 0..N-1 once each); each sample runs against a fresh local etcd, whose CPU
time and raft entries are recorded with the agents' CPU time, to tell which of the two bounds it.

A peer that does not form the round within ``CAP_S`` (``LARGE_CAP_S`` above 256 agents) is recorded
as failed (no time) and not run at larger N.
"""

from __future__ import annotations

import time

from benchmarks.common import Context, Result, Target, alternate, ratios, row
from benchmarks.workers.rdzv_agents import AgentSpec, etcd_metrics, join_outcome, process_cpu_s, simulate
from elastic_ddp.tools.etcd_server import EtcdServer, free_port

NAME = "rdzv_join"
TITLE = "Rendezvous at scale: N agents joining at once, per-node etcd handler vs the blob handler vs c10d"

CAP_S = 60  # join_timeout given to every variant; the blob handler and c10d did not form 256 in 600 s
# 1,000 simulated agents on a 2-core machine need longer than 60 s (see the notes of ``run``).
LARGE_CAP_S = 300
# Liveness of the simulated agents above 256: 1,000 agents (~6,000 threads) sharing 2 cores get
# ~1/500 of a core each, and with the default 5 s lease TTL their own renewals starve: leases end
# during the join, and each ending wakes every member. Real nodes do not share their CPU; these
# settings (a 30 s TTL, renewed every 5 s, each renewal given 10 s) keep the simulation's own
# scheduling out of the result. Measured without them: see the notes of ``run``.
LARGE_LIVENESS = {"keep_alive_interval": "5", "keep_alive_max_attempt": "6", "heartbeat_timeout": "10"}
PROCESSES = 4
PEERS = ("etcd-blob", "c10d")


def join_cap(n: int) -> int:
    """The join timeout given to every agent of a join of ``n``."""
    return CAP_S if n <= 256 else LARGE_CAP_S


def join_once(backend: str, n: int, ctx: Context, tag: str) -> dict[str, float]:
    """One simultaneous join of ``n`` agents on ``backend``; times, CPU and etcd raft entries."""
    cap = join_cap(n)
    scratch = ctx.scratch(f"{NAME}/{tag}")
    with EtcdServer(scratch / "etcd") as etcd:
        conf: dict[str, str] = dict(LARGE_LIVENESS) if n > 256 and backend == "etcd" else {}
        endpoint = etcd.endpoint
        tcp_store = None
        if backend == "c10d":
            from datetime import timedelta

            from torch.distributed import TCPStore

            # c10d's rendezvous lives in a TCPStore one agent hosts; here this process does.
            port = free_port()
            tcp_store = TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, timeout=timedelta(seconds=cap))
            endpoint, conf = f"127.0.0.1:{port}", {"is_host": "false", "read_timeout": str(cap)}
        before, etcd_cpu = etcd_metrics(etcd.endpoint), process_cpu_s(etcd.process.pid)
        wall = time.monotonic()
        spec = AgentSpec(backend, endpoint, n, join_timeout=cap, conf=conf, log_dir=str(scratch))

        def joined() -> dict:  # before the agents leave, which writes too
            return {"after": etcd_metrics(etcd.endpoint), "etcd_cpu_s": process_cpu_s(etcd.process.pid) - etcd_cpu}

        result = simulate(spec, PROCESSES, while_joined=joined)
        outcome = join_outcome(result, n)
        after = result["after"]
        del tcp_store
        return {
            **outcome,
            "agents_cpu_s": result["agents_cpu_s"],
            "etcd_cpu_s": result["etcd_cpu_s"],
            "raft_entries_per_node": (after["etcd_server_proposals_committed_total"]
                                      - before["etcd_server_proposals_committed_total"]) / n,  # fmt: skip
            "db_bytes_per_node": (after["etcd_mvcc_db_total_size_in_use_in_bytes"]
                                  - before["etcd_mvcc_db_total_size_in_use_in_bytes"]) / n,  # fmt: skip
            "sample_wall_s": time.monotonic() - wall,
        }


def run(ctx: Context) -> Result:
    sizes = [8] if ctx.smoke else [64, 256, 1000]
    result = Result(NAME, TITLE, params={"sizes": sizes, "processes": PROCESSES, "cap_s": CAP_S,
                                         "large_cap_s": LARGE_CAP_S, "repeats": ctx.repeats})  # fmt: skip
    alive = set(PEERS)  # peers still forming rounds at the sizes tried so far
    for n in sizes:
        variants = {"etcd": "etcd", **{p: p for p in PEERS if p in alive}}
        # A round of 1,000 takes a minute of setup per sample on 2 cores: fewer repeats there.
        repeats = ctx.repeats if n <= 256 else 1

        def variant(backend: str):
            return lambda i: join_once(backend, n, ctx, f"{backend}-{n}-{i}")

        samples = alternate({name: variant(name) for name in variants}, repeats)
        result.samples[f"n{n}"] = samples
        ours = samples["etcd"]
        target = {256: Target("<=", 5.0, "≤ 5 s")}.get(n)
        result.rows.append(row(f"{n} agents: etcd (per-node), join", ours.get("join_s", []), "s", target))
        for peer in variants:
            if peer == "etcd":
                continue
            joined = samples[peer].get("join_s", [])
            if len(joined) == repeats and len(ours.get("join_s", [])) == repeats:
                result.rows.append(row(f"{n} agents: {peer}, join", joined, "s"))
                result.rows.append(row(f"{n} agents: etcd / {peer}, join", ratios(ours["join_s"], joined),
                                       "ratio", Target("<=", 1.0, "≤ 1 (no slower)")))  # fmt: skip
            else:
                alive.discard(peer)
                failed = int(max(samples[peer]["failed_agents"]))
                result.notes.append(f"{peer} did not form a round of {n} agents within {join_cap(n)} s in "
                                    f"{repeats - len(joined)} of {repeats} tries ({failed} of {n} agents failed); "
                                    "not run at larger sizes.")  # fmt: skip
        result.rows.append(row(f"{n} agents: etcd, database bytes written per node", ours["db_bytes_per_node"], "bytes"))
        result.rows.append(row(f"{n} agents: etcd, raft entries per node", ours["raft_entries_per_node"], "count"))
        result.rows.append(row(f"{n} agents: etcd, etcd CPU during the join", ours["etcd_cpu_s"], "s"))
        result.rows.append(row(f"{n} agents: etcd, agents' CPU during the join", ours["agents_cpu_s"], "s"))
        if "etcd-blob" in variants and "etcd-blob" in alive:
            result.rows.append(row(f"{n} agents: etcd-blob, raft entries per node", samples["etcd-blob"]["raft_entries_per_node"], "count"))
    result.notes.append(
        f"Agents are threads over {PROCESSES} processes on this machine's {__import__('os').cpu_count()} cores, each "
        "with its own handler and etcd connection; 'agents' CPU' is their processes' CPU time from the start instant "
        "until the last join. Where it is close to cores x join time, Python (the GIL and gRPC in four processes), "
        "not etcd, bounds the result. Each agent keeps two gRPC streams open (its watches, its lease renewals), and "
        "gRPC's Python client wakes every thread blocked on a stream ten times a second: ~1.4 ms of CPU per agent per "
        "second while idle, measured on this machine -- negligible on a real node, 1.4 cores for 1,000 agents on one "
        "machine, which is why 1,000 are given a join timeout of " + f"{LARGE_CAP_S} s."
    )
    if any(n > 256 for n in sizes):
        result.notes.append(
            "Above 256 agents the simulated agents use a 30 s lease TTL renewed every 5 s (rdzv_conf "
            f"{', '.join(f'{k}={v}' for k, v in LARGE_LIVENESS.items())}): with the default 5 s TTL, 1,000 agents "
            "packed on this machine's cores starve their own renewals -- leases ended mid-join (800-1,000 endings "
            "per try) and every ending woke every member, so no try formed its round within 300 s. Real nodes do "
            "not share a CPU; at the defaults a node must only renew within 5 s on its own machine."
        )
    return result
