"""Rendezvous under contention: N simulated participants joining through EtcdV3RendezvousBackend at once.

This is the one-key backend torch's ``DynamicRendezvousHandler`` needs (kept for users who build
that handler themselves, and the state of the handler this package shipped before its per-node
one); ``bench_rdzv_join.py`` measures the handlers themselves.

Each participant does what torch's DynamicRendezvousHandler does to join: read the state, add
itself to the participants and heartbeat maps of torch's own ``_RendezvousState``, write it back
with ``set_state(state, token)``, and on a lost race retry with the winner's state (returned by
the failed compare-and-set). Participants are threads spread over a few processes (one etcd
client each), all released at the same wall-clock instant against one etcd.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import threading
import time
import uuid
from datetime import datetime, timezone

from benchmarks.common import Context, Result, alternate, ratios, row, summary
from elastic_ddp.tools.etcd_server import EtcdServer

NAME = "contention"
TITLE = "Rendezvous under contention: simultaneous joins by compare-and-set on one etcd key"

ETCD_MAX_REQUEST_BYTES = int(1.5 * (1 << 20))  # etcd's default --max-request-bytes
HOSTNAME_LEN = 40  # a typical cluster FQDN, e.g. "node-0123.rack-07.cluster.example.com"


def _join(backend, desc, start_at: float, out: list) -> None:
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    time.sleep(max(0.0, start_at - time.time()))
    begin = time.time()
    current = backend.get_state()
    retries = 0
    while True:
        state = _RendezvousState() if current is None else pickle.loads(current[0])
        token = None if current is None else current[1]
        state.participants[desc] = len(state.participants)
        state.last_heartbeats[desc] = datetime.now(timezone.utc)
        answer = backend.set_state(pickle.dumps(state), token)
        if answer is not None and answer[2]:
            out.append((begin, time.time(), retries))
            return
        retries += 1
        current = backend.get_state() if answer is None else answer[:2]


def _participants(endpoint: str, run_id: str, first: int, count: int, start_at: float, queue) -> None:
    """One process: ``count`` participant threads sharing one etcd client."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc

    from elastic_ddp.rendezvous.backend import EtcdV3RendezvousBackend
    from elastic_ddp.etcd import EtcdClient

    client = EtcdClient(endpoint, timeout=60)
    out: list = []
    threads = []
    for index in range(first, first + count):
        backend = EtcdV3RendezvousBackend(client, run_id)
        desc = _NodeDesc(f"node-{index:04d}.rack-{index % 64:02d}.cluster.example.com", 10_000 + index, 0)
        threads.append(threading.Thread(target=_join, args=(backend, desc, start_at, out)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    client.close()
    queue.put(out)


def contend(endpoint: str, n: int, processes: int) -> dict[str, float]:
    from elastic_ddp.rendezvous.backend import DEFAULT_KEY_PREFIX, state_key
    from elastic_ddp.etcd import EtcdClient

    run_id = f"contention-{uuid.uuid4().hex[:8]}"
    spawn = mp.get_context("spawn")
    queue = spawn.Queue()
    start_at = time.time() + 4.0  # time for every process to start and connect
    share = [n // processes + (1 if i < n % processes else 0) for i in range(processes)]
    procs = [
        spawn.Process(target=_participants, args=(endpoint, run_id, sum(share[:i]), share[i], start_at, queue))
        for i in range(processes)
    ]
    for proc in procs:
        proc.start()
    records = [record for _ in procs for record in queue.get(timeout=600)]
    for proc in procs:
        proc.join(30)
    with EtcdClient(endpoint) as client:
        kv = client.get(state_key(DEFAULT_KEY_PREFIX, run_id))
        stored = len(kv.value)
        client.delete(state_key(DEFAULT_KEY_PREFIX, run_id))
    if len(records) != n:
        raise RuntimeError(f"{len(records)} of {n} participants finished.")
    retries = [r for _, _, r in records]
    return {
        "completion_s": max(end for _, end, _ in records) - start_at,
        "total_retries": sum(retries),
        "max_retries": max(retries),
        "cas_per_s": (n + sum(retries)) / (max(end for _, end, _ in records) - start_at),
        "state_bytes": stored,
        "state_bytes_per_participant": stored / n,
    }


def discussion(bytes_per_participant: float, cas_per_s: float, small: int, large: int, growth: float) -> str:
    """The paper extrapolation to 1,000+ nodes, from the measured per-participant size and CAS rate."""
    b = bytes_per_participant
    limit_n = int(ETCD_MAX_REQUEST_BYTES / b)

    def blob(n: int) -> str:
        return f"{n * b / 1024:.0f} KiB"

    # Simultaneous join: round k has n-k writers; one wins, all read back the winner: ~n^2/2 CAS.
    def join_s(n: int) -> float:
        return n * n / 2 / cas_per_s

    return f"""### The one-key state at 1,000+ nodes (on paper)

Measured: about **{b:.0f} bytes of stored state per participant** (torch's pickled
`_RendezvousState` — a participants map and a heartbeat map — base64-encoded in one etcd key), and
about **{cas_per_s:.0f} compare-and-set attempts per second** against one local etcd. From {small} to
{large} participants the completion time grew **{growth:.1f}×** for 4× the participants (O(n²) predicts 16×,
bounded below by O(n) when the etcd round trip, not the blob, dominates).

What grows:
- **The blob is O(n):** {blob(1000)} at 1,000 nodes, {blob(4000)} at 4,000. Every read and every
  write moves all of it, and every agent decodes and re-pickles all of it.
- **A simultaneous join is O(n²) work:** all n agents race, one wins each CAS round and the n−1
  losers retry with the winner's state, so ~n²/2 attempts of an O(n) blob — O(n³) bytes. At the
  measured rate, 1,000 agents joining at once need ~{join_s(1000):.0f} s of CAS attempts, 4,000 ~{join_s(4000):.0f} s;
  torch's `join_timeout` (600 s) and `last_call_timeout` run meanwhile.
- **Heartbeats are writes of the same key:** each agent's keep-alive (every `keep_alive_interval`,
  1 s as it shipped, 5 s in torch's defaults) is a CAS of the whole blob. At 1,000 nodes and 1 s
  that is 1,000 writes/s of {blob(1000)} (~{1000 * 1000 * b / 1e6:.0f} MB/s through etcd's raft log) and
  constant conflicts for anyone trying to join or close a round.

Where it breaks:
- **etcd's request limit:** `--max-request-bytes` defaults to 1.5 MiB, so the state key stops being
  writable at about **{limit_n:,} participants** (earlier with longer host names); the join fails hard.
- Long before that, **contention and write amplification**: heartbeats alone saturate the key at a
  few hundred to a thousand nodes with a 1 s keep-alive; etcd's db also grows by one blob per write
  until compaction.

`torchrun --rdzv-backend=etcd` therefore runs the per-node handler (per-node keys under leases,
a round decided by one small compare-and-set, ranks read with O(1) range reads); its measured
costs and their extrapolation follow the `rdzv_join` and `rdzv_idle` tables.
"""


def run(ctx: Context) -> Result:
    small, large = (8, 16) if ctx.smoke else (64, 256)
    processes = 2 if ctx.smoke else 4
    result = Result(NAME, TITLE, params={"participants": [small, large], "processes": processes,
                                         "repeats": ctx.repeats, "state": "torch _RendezvousState, pickled"})
    with EtcdServer(ctx.scratch(f"{NAME}/etcd")) as etcd:
        samples = alternate(
            {f"n{small}": lambda i: contend(etcd.endpoint, small, processes),
             f"n{large}": lambda i: contend(etcd.endpoint, large, processes)},
            ctx.repeats,
        )
    result.samples = samples
    s, l = samples[f"n{small}"], samples[f"n{large}"]
    for n, m in ((small, s), (large, l)):
        result.rows += [
            row(f"{n} participants: completion", m["completion_s"], "s"),
            row(f"{n} participants: retries (total)", m["total_retries"], "count"),
            row(f"{n} participants: retries (worst participant)", m["max_retries"], "count"),
            row(f"{n} participants: CAS attempts per second", m["cas_per_s"], "1/s"),
            row(f"{n} participants: stored state per participant", m["state_bytes_per_participant"], "bytes"),
        ]
    growth = ratios(l["completion_s"], s["completion_s"])
    result.rows.append(row(f"completion {large} / {small}", growth, "ratio", note="O(n²) predicts 16"))
    result.rows.append(row(f"total retries {large} / {small}", ratios(l["total_retries"], s["total_retries"]), "ratio"))

    result.discussion = discussion(
        summary(l["state_bytes_per_participant"])["median"],
        summary(l["cas_per_s"])["median"],
        small, large, summary(growth)["median"] or 0.0,
    )
    return result
