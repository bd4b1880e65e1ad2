"""The step ledger's promise: ``read_ledger`` returns the job's history -- every step once, with
the samples of every rank of the group that trained it -- from files written by many torchrun
agents whose restart counts differ, through worker crashes, node kills, replacements, joins,
resumes from node memory, relaunches and clocks that disagree.

The ledgers are written by the real :class:`StepLedger` under the environment torchrun and the
etcd handler give each worker (one worker per agent, as in the multi-node soak), with a virtual
clock per host; the samples of each step come from the real data order.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

import elastic_ddp.data.ledger as ledger_module
from elastic_ddp.data import LedgerStep, StepLedger, exactly_once_problems, rank_slice, read_ledger
from elastic_ddp.worker.distributed import (
    ENV_GROUP_WORLD_SIZE,
    ENV_MASTER_ADDR,
    ENV_MASTER_PORT,
    ENV_RDZV_ROUND,
    ENV_RESTART_COUNT,
)
from tests.helpers.data import data_order

NUM_SAMPLES, BATCH, SEED, MAX_STEPS = 50, 6, 7, 45
ORDER = data_order(NUM_SAMPLES, BATCH, SEED, MAX_STEPS)  # the global batch of each step of an uninterrupted run


@dataclass
class Agent:
    """One node's torchrun agent: its host and its own restart count."""

    host: str
    restarts: int = 0  # TORCHELASTIC_RESTART_COUNT of its workers: failures of this node's workers
    skew: float = 0.0  # how far this host's clock is ahead of true time, in seconds


class Job:
    """Writes a run's ledger as the workers of an elastic job do, one worker group at a time."""

    def __init__(self, run_dir, monkeypatch, *, rounds: bool) -> None:
        self.run_dir = run_dir
        self._monkeypatch = monkeypatch
        self._rounds = rounds  # whether the rendezvous exports its round (the etcd handler does)
        self._round = 41
        self._port = 29400
        self._now = 1_700_000_000.0
        self._skew = 0.0
        monkeypatch.setattr(ledger_module, "time", SimpleNamespace(time=lambda: self._now + self._skew))

    def group(
        self, agents: list[Agent], *, resume: int, last: int, port: int | None = None,
        header_order: list[int] | None = None, recorded_last: set[int] | None = None, loss: float = 0.0,
    ) -> int:
        """One rendezvous round: ``agents[i]`` hosts rank ``i`` (an agent named twice runs two
        workers); the workers write their headers
        in ``header_order`` (default: by rank) a few milliseconds apart, then train steps
        ``resume + 1`` to ``last`` in lockstep. Step ``last`` is recorded by the ranks in
        ``recorded_last`` only (default: all; fewer: the group died while they wrote it). Each
        step's loss is ``loss + step``. Returns the round's worker-store port."""
        self._round += 1
        self._port += 1
        port = port or self._port
        world_size, nodes = len(agents), len({id(agent) for agent in agents})
        ledgers: dict[int, StepLedger] = {}
        for rank in header_order or range(world_size):
            env = {ENV_MASTER_ADDR: agents[0].host, ENV_MASTER_PORT: str(port),
                   ENV_RESTART_COUNT: str(agents[rank].restarts), ENV_GROUP_WORLD_SIZE: str(nodes)}  # fmt: skip
            for name, value in env.items():
                self._monkeypatch.setenv(name, value)
            if self._rounds:
                self._monkeypatch.setenv(ENV_RDZV_ROUND, str(self._round))
            else:
                self._monkeypatch.delenv(ENV_RDZV_ROUND, raising=False)
            self._now += 0.003
            self._skew = agents[rank].skew
            ledgers[rank] = StepLedger(self.run_dir, rank=rank, world_size=world_size, resume_step=resume, enabled=True)
        for step in range(resume + 1, last + 1):
            self._now += 0.2
            writers = recorded_last if step == last and recorded_last is not None else range(world_size)
            for rank in range(world_size):
                ledgers[rank].started(step, rank_slice(ORDER[step - 1], rank, world_size))
            for rank in writers:
                ledgers[rank].finished(step, loss + step)
        for each in ledgers.values():
            each.close()
        self._now += 2.0  # the agents notice, stop the workers and meet again
        return port


def assert_history(history, world_sizes: dict[range, int]) -> None:
    """Every step once, each trained by every rank of its group, consuming the next samples."""
    expected = {step: size for steps, size in world_sizes.items() for step in steps}
    assert list(history) == sorted(expected), f"steps missing or repeated: {list(history)}"
    for step, entry in history.items():
        assert entry.world_size == expected[step], step
        assert sorted(entry.indices) == list(range(entry.world_size)), f"step {step}: ranks {sorted(entry.indices)}"
        assert entry.all_indices == ORDER[step - 1], step


@pytest.mark.parametrize("rounds", [True, False], ids=["etcd-round", "per-round-store"])
def test_a_multi_node_job_through_crashes_kills_joins_and_replacements_has_every_step_once_from_every_rank(
    rounds, tmp_path, monkeypatch
):
    job = Job(tmp_path, monkeypatch, rounds=rounds)
    a, b, c = Agent("10.0.0.1"), Agent("10.0.0.2"), Agent("10.0.0.3")
    # c's worker is SIGKILLed in step 15, after ranks 0 and 1 recorded it; only c's agent counts a
    # failure, the others restart for the membership change.
    job.group([a, b, c], resume=0, last=15, recorded_last={0, 1})
    c.restarts += 1
    # Ranks change hosts; the headers arrive out of rank order. Then node b is killed.
    job.group([c, a, b], resume=10, last=22, header_order=[2, 0, 1])
    # The survivors go on at world size 2 from node memory (step 20) ...
    job.group([a, c], resume=20, last=26)
    # ... until node d joins (restart count 0): a stop checkpoint at step 26 and a new round.
    d = Agent("10.0.0.4")
    job.group([a, c, d], resume=26, last=33, header_order=[1, 2, 0])
    a.restarts += 1  # an exception in a's worker: back to the checkpoint of step 30
    job.group([d, a, c], resume=30, last=38)
    # Node c dies and is replaced by e, a fresh agent.
    e = Agent("10.0.0.5")
    job.group([d, a, e], resume=35, last=MAX_STEPS)
    assert_history(read_ledger(tmp_path), {range(1, 21): 3, range(21, 27): 2, range(27, MAX_STEPS + 1): 3})


def test_a_resume_from_a_newer_state_than_the_attempt_before_continues_the_one_that_reached_it(tmp_path, monkeypatch):
    job = Job(tmp_path, monkeypatch, rounds=True)
    a, b, c = Agent("10.0.0.1"), Agent("10.0.0.2"), Agent("10.0.0.3")
    job.group([a, b, c], resume=0, last=30)  # its nodes hold step 28's state in memory
    # a, b and c drop out; two other nodes resume from the durable checkpoint of step 20 and die.
    job.group([Agent("10.0.0.4"), Agent("10.0.0.5")], resume=20, last=23)
    # a, b and c come back; the newest state anywhere is their memory's step 28. Steps 21-23 of
    # the two-node attempt are a branch no state of the job descends from.
    job.group([a, b, c], resume=28, last=35)
    history = read_ledger(tmp_path)
    assert_history(history, {range(1, 36): 3})


def test_a_step_whose_loss_no_rank_recorded_counts_where_the_next_attempt_resumed_after_it(tmp_path, monkeypatch):
    job = Job(tmp_path, monkeypatch, rounds=True)
    a, b, c = Agent("10.0.0.1"), Agent("10.0.0.2"), Agent("10.0.0.3")
    # Node c dies after its gradients of step 12 went into the all-reduce: every rank started step
    # 12, none recorded its loss (that all-reduce failed), and a and b kept the state after it.
    job.group([a, b, c], resume=0, last=12, recorded_last=set())
    job.group([a, b], resume=12, last=20)
    history = read_ledger(tmp_path)
    assert_history(history, {range(1, 13): 3, range(13, 21): 2})
    assert math.isnan(history[12].loss) and history[11].loss == 11.0 and history[13].loss == 13.0
    # Had they kept step 11 (c died in step 12's all-reduce), step 12 comes from the attempt that redid it.
    job = Job(tmp_path / "again", monkeypatch, rounds=True)
    job.group([a, b, c], resume=0, last=12, recorded_last=set())
    job.group([a, b], resume=11, last=20)
    assert_history(read_ledger(tmp_path / "again"), {range(1, 12): 3, range(12, 21): 2})


def test_the_last_attempts_step_that_no_rank_completed_is_not_history(tmp_path, monkeypatch):
    job = Job(tmp_path, monkeypatch, rounds=True)
    job.group([Agent("10.0.0.1"), Agent("10.0.0.2")], resume=0, last=9, recorded_last=set())
    assert list(read_ledger(tmp_path)) == list(range(1, 9))


def test_a_one_node_job_launched_again_with_the_same_port_and_restart_count_is_another_attempt(tmp_path, monkeypatch):
    # Plain `torchrun --nproc-per-node=2` (static rendezvous): one agent, MASTER_PORT 29500 every
    # launch, restart count 0 at every launch. The first launch dies before its first checkpoint.
    job = Job(tmp_path, monkeypatch, rounds=False)
    node = Agent("127.0.0.1")
    job.group([node, node], resume=0, last=8, port=29500, loss=100.0)
    job.group([node, node], resume=0, last=5, port=29500)
    history = read_ledger(tmp_path)
    assert_history(history, {range(1, 6): 2})
    assert [entry.loss for entry in history.values()] == [1.0, 2.0, 3.0, 4.0, 5.0]  # the second launch's


def test_attempts_run_in_the_order_the_files_list_them_whatever_the_hosts_clocks_say(tmp_path, monkeypatch):
    job = Job(tmp_path, monkeypatch, rounds=True)
    a, late = Agent("10.0.0.1"), Agent("10.0.0.2", skew=-30.0)  # the joining host's clock is 30 s behind
    job.group([a], resume=0, last=10)
    job.group([late, a], resume=10, last=20)  # its earliest header is stamped before the first attempt's
    lines = [json.loads(line) for line in (tmp_path / "ledger" / "rank-0.jsonl").read_text().splitlines()]
    first, second = [line["time"] for line in lines if "attempt" in line]
    assert second < first - 20  # by the headers' times the second attempt came first
    assert_history(read_ledger(tmp_path), {range(1, 11): 1, range(11, 21): 2})


def test_a_ledger_written_before_the_round_was_in_the_attempt_id_reads_as_before(tmp_path):
    # One node, two attempts (restart counts 0 and 1), in the old header format.
    lines = {0: [], 1: []}
    for restart, resume, last, started in [(0, 0, 7, 1000.0), (1, 5, 9, 1010.0)]:
        for rank in (0, 1):
            lines[rank].append({"attempt": f"127.0.0.1:29500/{restart}", "resume_step": resume, "world_size": 2,
                                "rank": rank, "time": started + rank / 100})  # fmt: skip
            lines[rank] += [{"step": s, "indices": rank_slice(ORDER[s - 1], rank, 2), "loss": float(s)}
                            for s in range(resume + 1, last + 1)]  # fmt: skip
    (tmp_path / "ledger").mkdir()
    for rank, records in lines.items():
        text = "".join(json.dumps(record) + "\n" for record in records)
        (tmp_path / "ledger" / f"rank-{rank}.jsonl").write_text(text)
    assert_history(read_ledger(tmp_path), {range(1, 10): 2})


def test_files_that_disagree_on_the_order_still_give_the_last_attempts_steps(tmp_path, monkeypatch):
    # The one case the pairing cannot untangle: without the round, a port handed out again to a
    # group with the same resume step and world size as a group whose rank 1 died before its
    # header. Rank 1's file pairs its header of the third group with the first group's, so it
    # lists the attempts in another order than rank 0's file; the headers' times decide. The read
    # ends with the last attempt's steps -- without rank 1's share, which went to the first group.
    job = Job(tmp_path, monkeypatch, rounds=False)
    a, b = Agent("10.0.0.1"), Agent("10.0.0.2")
    port = job.group([a, b], resume=0, last=0, header_order=[0])
    job.group([a, b], resume=0, last=5)
    job.group([a, b], resume=0, last=8, port=port)
    history = read_ledger(tmp_path)
    assert list(history) == list(range(1, 9))
    assert all(history[s].indices[0] == rank_slice(ORDER[s - 1], 0, 2) for s in history)


def test_a_step_line_before_any_header_is_an_error_naming_the_file_and_line(tmp_path):
    (tmp_path / "ledger").mkdir()
    (tmp_path / "ledger" / "rank-0.jsonl").write_text('{"step":1,"indices":[1],"loss":1.0}\n')
    with pytest.raises(ValueError, match=r"rank-0\.jsonl:1: a step record before any attempt header"):
        read_ledger(tmp_path)


def test_a_torn_line_is_an_error_naming_the_file_and_line(tmp_path):
    (tmp_path / "ledger").mkdir()
    header = {"attempt": "h:1/round-3", "resume_step": 0, "world_size": 1, "rank": 0, "time": 1.0}
    (tmp_path / "ledger" / "rank-0.jsonl").write_text(json.dumps(header) + '\n{"step":1,"indi\n')
    with pytest.raises(ValueError, match=r"rank-0\.jsonl:2: not a ledger record"):
        read_ledger(tmp_path)


def test_no_ledger_is_file_not_found_saying_data_ledger_was_off(tmp_path):
    with pytest.raises(FileNotFoundError, match="was data.ledger enabled"):
        read_ledger(tmp_path)


def test_the_exactly_once_verdict_names_what_is_wrong():
    # 5 samples an epoch, 2 per step: step 3 crosses into the second epoch.
    def history(*batches):
        return {s: LedgerStep(s, 1, 0.0, {0: list(b)}) for s, b in enumerate(batches, start=1)}

    assert exactly_once_problems(history([0, 1], [2, 3], [4, 0], [1, 2]), 5) == []
    assert exactly_once_problems(history([0, 1], [1, 3], [4, 0]), 5) == ["epoch 0 consumed a sample more than once"]
    assert exactly_once_problems(history([0, 1], [2, 3], [5, 0]), 5) == ["epoch 0 left samples out"]
    skipped = {1: LedgerStep(1, 1, 0.0, {0: [0, 1]}), 3: LedgerStep(3, 1, 0.0, {0: [2, 3]})}
    assert exactly_once_problems(skipped, 5) == ["the steps do not run 1..2 once each (missing: [2])"]


def test_a_header_names_the_agents_restart_count_0_outside_torchrun(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    ledger = StepLedger(tmp_path, rank=0, world_size=1, resume_step=0, enabled=True)
    ledger.started(1, [0, 1])
    ledger.finished(1, 0.5)
    ledger.close()
    header = json.loads((tmp_path / "ledger" / "rank-0.jsonl").read_text().splitlines()[0])
    assert header["restart"] == 2
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    ledger = StepLedger(tmp_path / "outside", rank=0, world_size=1, resume_step=0, enabled=True)
    ledger.close()
    assert json.loads((tmp_path / "outside" / "ledger" / "rank-0.jsonl").read_text())["restart"] == 0
    assert read_ledger(tmp_path)[1].indices == {0: [0, 1]}
