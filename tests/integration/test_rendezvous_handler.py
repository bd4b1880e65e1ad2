"""The per-node etcd rendezvous handler against a real etcd: rounds, ranks, leaving, dying,
joining, spares, closing, timeouts, idle cost, outages.

Handlers run in threads of this process, each with its own etcd client, as torchrun's agents
would on separate nodes. Liveness is shortened (lease TTL 2 s, last call 1 s) to keep the tests
quick; no test asserts a duration.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousTimeoutError,
)

from elastic_ddp.processes import agent_pid
from elastic_ddp.worker.stop import (
    ENV_AGENT_PID, ENV_SETTINGS_ERROR_DIR, members_gone, nodes_joining, report_leaving, report_settings_error,
)  # fmt: skip
from elastic_ddp.tools.etcd_server import EtcdServer
from elastic_ddp.rendezvous import plugin
from elastic_ddp.etcd import EtcdClient, EtcdConnectionError, Range
from elastic_ddp.rendezvous import join as join_module
from elastic_ddp.rendezvous import node as node_module
from elastic_ddp.contract import ENV_RDZV_ROUND
from elastic_ddp.rendezvous.handler import EtcdRendezvousHandler, InvalidSettingsError
from elastic_ddp.rendezvous.liveness import LivenessListener
from elastic_ddp.rendezvous.rounds import LAST_CALL, RoundRecord, node_key
from elastic_ddp.rendezvous.view import RunKeys
from tests.helpers.nodes import record_raises, wait_for

FAST = {"last_call_timeout": "1", "first_round_timeout": "1", "keep_alive_interval": "1", "keep_alive_max_attempt": "2", "join_timeout": "30"}


@pytest.fixture
def run(etcd_endpoint, etcd_prefix, monkeypatch):
    """A factory of handlers of one fresh run; every handler leaves at the end of the test."""
    monkeypatch.setenv(plugin.DISABLE_SHARED_STORE_ENV, "1")
    # The nodes have made-up addresses but run here: their agents answer probes on this host.
    monkeypatch.setattr(join_module, "LivenessListener", lambda host: LivenessListener("127.0.0.1"))
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    made: list[EtcdRendezvousHandler] = []

    def make(min_nodes: int, max_nodes: int, addr: str, endpoint: str = etcd_endpoint, **conf) -> EtcdRendezvousHandler:
        params = RendezvousParameters(
            backend="etcd-v3", endpoint=endpoint, run_id=run_id, min_nodes=min_nodes, max_nodes=max_nodes,
            local_addr=addr, key_prefix=etcd_prefix, **{**FAST, **conf},
        )  # fmt: skip
        made.append(plugin.create_rdzv_handler(params))
        return made[-1]

    make.keys = RunKeys(etcd_prefix, run_id)
    try:
        yield make
    finally:
        for handler in made:
            handler.leave()


class Joining:
    """``next_rendezvous()`` of one handler in a thread."""

    def __init__(self, handler: EtcdRendezvousHandler) -> None:
        self.handler = handler
        self.info: RendezvousInfo | None = None
        self.error: BaseException | None = None
        self.round: str | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.info = self.handler.next_rendezvous()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.error = exc

    def result(self, timeout: float = 60) -> RendezvousInfo:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"{self.handler.node} is still joining"
        if self.error is not None:
            raise self.error
        return self.info


def join_all(*handlers: EtcdRendezvousHandler) -> list[RendezvousInfo]:
    joins = [Joining(h) for h in handlers]
    return [j.result() for j in joins]


def record(client: EtcdClient, keys: RunKeys) -> RoundRecord | None:
    kv = client.get(keys.round)
    return None if kv is None else RoundRecord.decode(kv.value, "round", kv.mod_revision)


def ranks(infos: list[RendezvousInfo]) -> list[tuple[int, int]]:
    return [(i.rank, i.world_size) for i in infos]


def test_nodes_form_one_round_ranked_in_torchs_node_order_and_export_the_round(run, monkeypatch):
    monkeypatch.delenv(ENV_RDZV_ROUND, raising=False)
    handlers = [run(3, 3, addr) for addr in ("10.0.0.3", "10.0.0.1", "10.0.0.2")]
    infos = join_all(*handlers)
    assert ranks(infos) == [(2, 3), (0, 3), (1, 3)]  # torch sorts nodes by address, then pid, then counter
    first = int(__import__("os").environ[ENV_RDZV_ROUND])
    assert first > 0
    # The rank-0 node published MASTER_ADDR/PORT for its workers in the round's store.
    assert {i.bootstrap_store_info.master_addr for i in infos} == {"10.0.0.1"}
    # A new round: ranks stay where they were, the round number grows.
    assert ranks(join_all(*handlers)) == [(2, 3), (0, 3), (1, 3)]
    assert int(__import__("os").environ[ENV_RDZV_ROUND]) > first


def test_the_last_call_admits_a_node_that_arrives_within_it(run, etcd_client):
    first = Joining(run(1, 3, "10.0.0.1", first_round_timeout="3"))
    wait_for(lambda: getattr(record(etcd_client, run.keys), "state", None) == LAST_CALL, 30, what="the last call")
    second = Joining(run(1, 3, "10.0.0.2", first_round_timeout="3"))
    assert ranks([first.result(), second.result()]) == [(0, 2), (1, 2)]


# A lease and a last call far longer than the test may wait: a round that completes did so on a probe.
SLOW_TO_NOTICE = {"last_call_timeout": "120", "keep_alive_max_attempt": "120"}


def _killed(handler: EtcdRendezvousHandler) -> None:
    """What SIGKILL of an agent leaves behind: a lease nobody renews that etcd still holds, and
    nothing listening where its registration says its agent answers."""
    handler._joiner._lease._keep_alive.close()
    handler._joiner._liveness.close()


def test_after_a_failure_the_round_completes_without_waiting_for_a_node_whose_agent_is_gone(run, etcd_client):
    a, b, c = (run(1, 3, "127.0.0.1", **SLOW_TO_NOTICE) for _ in range(3))
    join_all(a, b, c)
    _killed(c)
    # The survivors' workers failed on the dead peer: their agents call for a new round.
    infos = join_all(a, b)
    assert ranks(infos) == [(0, 2), (1, 2)]
    # Neither c's lease (120 s) nor the last call (120 s) ended: the probe told the survivors.
    assert etcd_client.lease_ttl(c._joiner._lease.current) > 60
    previous = record(etcd_client, run.keys).round - 1
    assert etcd_client.range(Range.prefix(run.keys.joins(previous), count_only=True)).count == 0  # c's removed


def test_while_a_round_trains_a_member_whose_agent_is_gone_is_removed_at_once_and_every_agent_restarts(run, etcd_client):
    a, b, c = (run(1, 3, "127.0.0.1", **SLOW_TO_NOTICE) for _ in range(3))
    join_all(a, b, c)
    assert [h.num_nodes_waiting() for h in (a, b, c)] == [0, 0, 0]
    _killed(b)
    # Its predecessor in the ring probes it: no collective failed, its lease (120 s) still runs.
    wait_for(lambda: a.num_nodes_waiting() == 1 and c.num_nodes_waiting() == 1, 10, what="b's departure")
    assert etcd_client.lease_ttl(b._joiner._lease.current) > 60
    # Each agent told its workers why it stops them, before it does.
    joined = record(etcd_client, run.keys).round
    assert members_gone(a.settings_error_dir) == members_gone(c.settings_error_dir) == f"1 node(s) left round {joined}"
    assert ranks(join_all(a, c)) == [(0, 2), (1, 2)]
    assert members_gone(a.settings_error_dir) is None  # the next workers start in a group of live nodes


def test_a_node_waiting_to_join_marks_the_members_restart_as_one_for_a_join_and_a_departure_does_not(run, etcd_client):
    a, b = run(1, 4, "127.0.0.1"), run(1, 4, "127.0.0.1")
    join_all(a, b)
    joined = record(etcd_client, run.keys).round
    newcomer = Joining(run(1, 4, "127.0.0.1"))
    wait_for(lambda: a.num_nodes_waiting() == 1 and b.num_nodes_waiting() == 1, 30, what="the new round")
    # Both members stay: each agent tells its workers the stop only admits a node.
    assert nodes_joining(a.settings_error_dir) == nodes_joining(b.settings_error_dir) == (
        f"round {joined + 1} was opened after round {joined}"
    )
    assert members_gone(a.settings_error_dir) is None
    infos = join_all(a, b)
    assert sorted(ranks([*infos, newcomer.result()])) == [(0, 3), (1, 3), (2, 3)]
    assert nodes_joining(a.settings_error_dir) is None  # cleared for the next workers
    # A member that dies: a departure, never a join.
    _killed(newcomer.handler)
    wait_for(lambda: a.num_nodes_waiting() >= 1, 10, what="the departure")
    assert members_gone(a.settings_error_dir) is not None and nodes_joining(a.settings_error_dir) is None


def test_each_member_probes_one_other_in_a_ring_and_a_round_of_one_probes_none(run, monkeypatch):
    class Recorded:
        def __init__(self, address, *args, **kwargs) -> None:
            self.address = address

        def stop(self) -> None:
            pass

    monkeypatch.setattr(join_module, "SuccessorWatch", Recorded)
    handlers = [run(1, 3, "127.0.0.1") for _ in range(3)]
    join_all(*handlers)
    probed = {h._joiner._liveness.port: h._joiner._successor.address[1] for h in handlers}
    assert sorted(probed.values()) == sorted(probed)  # every node probed, by exactly one other
    assert all(own != other for own, other in probed.items())
    join_all(handlers[0])
    assert handlers[0]._joiner._successor is None


def test_a_node_whose_agent_still_answers_is_waited_for(run, etcd_client):
    a, b = run(1, 3, "127.0.0.1", last_call_timeout="2"), run(1, 3, "127.0.0.1", last_call_timeout="2")
    join_all(a, b)
    # b's agent lives (its port answers) but it does not come over, as while it stops its workers.
    started = time.monotonic()
    (info,) = join_all(a)
    assert ranks([info]) == [(0, 1)]
    assert time.monotonic() - started >= 2  # the last call was waited out
    previous = record(etcd_client, run.keys).round - 1
    assert etcd_client.range(Range.prefix(run.keys.joins(previous), count_only=True)).count == 1  # b's, untouched


def test_a_member_that_leaves_is_a_membership_change_answered_without_etcd(run, monkeypatch):
    a, b = run(1, 3, "10.0.0.1"), run(1, 3, "10.0.0.2")
    join_all(a, b)
    assert a.num_nodes_waiting() == 0
    b.leave()  # what the atexit hook does when a preempted agent exits

    def no_requests(*args, **kwargs):
        raise AssertionError("num_nodes_waiting() made an etcd request")

    wait_for(lambda: a.num_nodes_waiting() == 1, 30, what="the departure to be seen")
    with monkeypatch.context() as patched:
        patched.setattr(a._client, "request", no_requests)
        assert a.num_nodes_waiting() == 1  # from watched state only
    assert ranks(join_all(a)) == [(0, 1)]


def as_worker_of(handler: EtcdRendezvousHandler, monkeypatch: pytest.MonkeyPatch) -> None:
    """This process speaks as a worker of ``handler``'s agent (what the agent exports to its workers)."""
    monkeypatch.setenv(ENV_SETTINGS_ERROR_DIR, handler.settings_error_dir)
    monkeypatch.setenv(ENV_AGENT_PID, str(agent_pid()))


def test_a_node_whose_workers_report_it_leaving_leaves_the_round_at_once_and_may_join_again(run, monkeypatch):
    a, b, c = (run(1, 3, f"10.0.0.{i}") for i in (1, 2, 3))
    join_all(a, b, c)
    # b is preempted: its workers committed the stop checkpoint and say so; its agent is still
    # waiting for them to exit, and the others need not.
    as_worker_of(b, monkeypatch)
    assert report_leaving("rank 1 stopped at step 7")
    wait_for(lambda: a.num_nodes_waiting() == 1 and c.num_nodes_waiting() == 1, 10, what="b's departure")
    assert ranks(join_all(a, c)) == [(0, 2), (1, 2)]
    # b's agent goes on after all (only its workers were signalled): it joins again, under a new lease.
    joining = Joining(b)
    wait_for(lambda: a.num_nodes_waiting() == 1, 30, what="b waiting to join again")
    assert sorted(ranks([*join_all(a, c), joining.result()])) == [(0, 3), (1, 3), (2, 3)]


def test_a_node_restarting_its_workers_for_a_join_stays_whatever_its_workers_report(run):
    a, b = run(1, 4, "10.0.0.1"), run(1, 4, "10.0.0.2")
    join_all(a, b)
    newcomer = Joining(run(1, 4, "10.0.0.3"))
    wait_for(lambda: a.num_nodes_waiting() == 1 and b.num_nodes_waiting() == 1, 30, what="the new round")
    lease = b._joiner._lease.current
    b._leave_round_early("rank 1 stopped at step 7")  # what its listener calls on a worker's report
    assert (b._joiner._lease.current == lease and a.num_nodes_waiting() == 1
            and members_gone(a.settings_error_dir) is None)  # fmt: skip
    assert sorted(ranks([*join_all(a, b), newcomer.result()])) == [(0, 3), (1, 3), (2, 3)]


def test_each_rounds_rank_0_agent_hosts_a_fresh_worker_store_that_listens_before_the_round_completes(run):
    a, b = run(1, 2, "127.0.0.1"), run(1, 2, "127.0.0.1")
    infos = join_all(a, b)
    (address,) = {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}
    # Every worker is a client (torch's agent exports use_agent_store), and the server is up before
    # any agent learns its address: a worker's first connect succeeds, with no retry back-off.
    assert a.use_agent_store and b.use_agent_store
    worker = dist.TCPStore(*address, is_master=False, timeout=timedelta(seconds=10))
    worker.set("gloo/rank-0", "an address of this round's group")
    infos = join_all(a, b)
    (again,) = {(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}
    # The next round's workers find no key of the last group (gloo would read a dead peer's address).
    assert not dist.TCPStore(*again, is_master=False, timeout=timedelta(seconds=10)).check(["gloo/rank-0"])


def test_a_node_that_dies_is_gone_for_the_others_when_its_lease_expires(run):
    a, b = run(1, 3, "10.0.0.1"), run(1, 3, "10.0.0.2")
    join_all(a, b)
    # b's process freezes or dies: nothing renews its lease, nothing revokes it.
    b._joiner._lease._keep_alive.close()
    b._joiner._stream.close()
    wait_for(lambda: a.num_nodes_waiting() == 1, 30, what="the lease of the dead node to expire")
    assert ranks(join_all(a)) == [(0, 1)]


def test_a_newcomer_does_not_form_a_round_alone_while_the_group_stops_to_admit_it(run):
    a, b = run(1, 3, "10.0.0.1"), run(1, 3, "10.0.0.2")
    join_all(a, b)
    c = Joining(run(1, 3, "10.0.0.3"))
    wait_for(lambda: a.num_nodes_waiting() == 1 and b.num_nodes_waiting() == 1, 30, what="the newcomer to be seen")
    # Two last calls later the newcomer is still waiting for the group (it has the minimum alone).
    c.thread.join(2.5)
    assert c.thread.is_alive() and c.error is None
    infos = join_all(a, b)
    assert ranks([*infos, c.result()]) == [(0, 3), (1, 3), (2, 3)]


class RecordingTemplate:
    """Stands in for the workers' template: records how long a node waited for it before joining."""

    waits: list[tuple[str, str]] = []

    def __init__(self, directory: str) -> None:
        self.directory, self.alive = directory, True

    def environment(self) -> dict[str, str]:
        return {}

    def wait_ready(self, timeout_s: float) -> bool:
        RecordingTemplate.waits.append((self.directory, "torch imported"))
        return True

    def warm_up(self, timeout_s: float) -> bool:
        RecordingTemplate.waits.append((self.directory, "everything imported"))
        return True

    def close(self) -> None:
        self.alive = False


def test_a_node_waits_for_a_warm_template_only_when_it_joins_a_running_job(run, monkeypatch):
    # At a first formation every worker starts anyway: the node registers at once. A node that
    # arrives at a running job restarts every rank: it registers once its workers can start warm.
    monkeypatch.setenv(node_module.ENV_PRESTART, "1")
    monkeypatch.setattr(node_module, "Template", RecordingTemplate)
    monkeypatch.setattr(RecordingTemplate, "waits", [])
    a, b = run(1, 3, "10.0.0.1"), run(1, 3, "10.0.0.2")
    join_all(a, b)
    assert RecordingTemplate.waits == []  # the workers wait for their template, not the rendezvous
    c = Joining(run(1, 3, "10.0.0.3"))
    wait_for(lambda: a.num_nodes_waiting() == 1, 30, what="the newcomer to be seen")
    join_all(a, b)
    c.result()
    assert RecordingTemplate.waits == [(c.handler.settings_error_dir, "everything imported")]


def test_a_full_round_keeps_a_spare_which_takes_part_when_a_member_leaves(run, etcd_client, monkeypatch):
    # A long last call: the next round may complete early only because everyone expected is there.
    a, b = run(1, 2, "10.0.0.1", last_call_timeout="10"), run(1, 2, "10.0.0.2", last_call_timeout="10")
    join_all(a, b)
    # The spare's join clock runs while the test waits for the departure: give it room on a loaded machine.
    spare_handler = run(1, 2, "10.0.0.3", join_timeout="120", last_call_timeout="10")
    # The spare reacts to the departure late, so the remaining member certainly rejoins first.
    register = spare_handler._joiner._register

    def late_register(*args, **kwargs):
        time.sleep(0.5)
        return register(*args, **kwargs)

    monkeypatch.setattr(spare_handler._joiner, "_register", late_register)
    spare = Joining(spare_handler)
    spare.thread.join(2.5)
    assert spare.thread.is_alive() and spare.error is None
    assert a.num_nodes_waiting() == 0  # a spare is no reason to restart a full group
    # The spare is on record for the full round, so the round after a departure waits for it.
    full_round = record(etcd_client, run.keys).round
    assert etcd_client.range(Range.prefix(run.keys.joins(full_round), count_only=True)).count == 3
    b.leave()
    wait_for(lambda: a.num_nodes_waiting() >= 1, 30, what="the departure to be seen")
    assert ranks([*join_all(a), spare.result(timeout=150)]) == [(0, 2), (1, 2)]


def test_a_node_whose_lease_ends_while_it_waits_for_a_round_registers_again(run, etcd_client):
    def registrations() -> int:
        return etcd_client.range(Range.prefix(run.keys.base + "joins/", count_only=True)).count

    first = Joining(run(2, 2, "10.0.0.1", join_timeout="20"))
    wait_for(lambda: registrations() == 1 and first.handler._joiner._lease.current is not None, 30,
             what="the first registration")  # fmt: skip
    lease = first.handler._joiner._lease.current
    # As when its renewals were starved past the TTL: etcd drops the lease and the key under it.
    etcd_client.revoke_lease(lease)
    wait_for(lambda: registrations() == 1 and first.handler._joiner._lease.current not in (None, lease), 30,
             what="the node to register again under a new lease")  # fmt: skip
    second = Joining(run(2, 2, "10.0.0.2", join_timeout="20"))
    assert ranks([first.result(), second.result()]) == [(0, 2), (1, 2)]


def test_shutdown_closes_the_rendezvous_and_takes_the_nodes_registration_with_it(run, etcd_client):
    a, b = run(1, 2, "10.0.0.1"), run(1, 2, "10.0.0.2")
    join_all(a, b)
    # The spare's join clock runs while the test waits for the departure: give it room on a loaded machine.
    spare = Joining(run(1, 2, "10.0.0.3", join_timeout="120"))
    spare.thread.join(2.5)
    assert spare.thread.is_alive() and spare.error is None
    assert a.shutdown() is True
    assert b.is_closed() and b.num_nodes_waiting() == 0
    with pytest.raises(RendezvousClosedError):
        b.next_rendezvous()
    with pytest.raises(RendezvousGracefulExitError):
        spare.result()
    keys = [kv.key for kv in etcd_client.get_prefix(run.keys.base)]
    assert not any(b"10.0.0.1" in key for key in keys)  # a's registration went with its lease
    round_kv = etcd_client.get(run.keys.round)
    assert 0 < etcd_client.lease_ttl(round_kv.lease) <= plugin.DEFAULT_RUN_TTL  # the record expires too


SETTINGS_ERROR = "Invalid configuration (flags):\n  trian.max_steps: unknown setting; did you mean train.max_steps?"


def report_as_worker_of(handler: EtcdRendezvousHandler, monkeypatch) -> None:
    """What launch() does in a worker whose settings are invalid, as a child of ``handler``'s agent."""
    monkeypatch.setenv(ENV_SETTINGS_ERROR_DIR, handler.settings_error_dir)
    monkeypatch.setenv(ENV_AGENT_PID, str(os.getppid()))  # this process stands in for the worker
    assert report_settings_error(SETTINGS_ERROR)


def test_a_workers_settings_error_ends_the_job_on_every_node_with_its_message(run, etcd_client, monkeypatch):
    a, b = run(1, 2, "10.0.0.1"), run(1, 2, "10.0.0.2")
    join_all(a, b)
    spare = Joining(run(1, 2, "10.0.0.3", join_timeout="120"))
    spare.thread.join(2.5)
    assert spare.thread.is_alive() and spare.error is None
    report_as_worker_of(a, monkeypatch)

    def no_requests(*args, **kwargs):
        raise AssertionError("num_nodes_waiting() made an etcd request")

    with monkeypatch.context() as patched:
        patched.setattr(a._client, "request", no_requests)
        assert a.num_nodes_waiting() == 1  # the agent restarts its healthy group: no restart is counted
    assert b.num_nodes_waiting() == 0
    with pytest.raises(InvalidSettingsError) as raised:
        a.next_rendezvous()
    message = str(raised.value)
    assert message.endswith(SETTINGS_ERROR) and f"node '{a.node}'" in message
    closed = record(etcd_client, run.keys)
    assert closed.closed and closed.reason.endswith(SETTINGS_ERROR)
    # The other member learns it from its watch, and so does the spare (not a graceful exit: the job failed).
    wait_for(lambda: b.num_nodes_waiting() == 1, 30, what="the closed rendezvous to reach the other node")
    with pytest.raises(InvalidSettingsError) as other:
        b.next_rendezvous()
    assert str(other.value) == message
    with pytest.raises(InvalidSettingsError) as from_spare:
        spare.result()
    assert str(from_spare.value) == message
    assert a.shutdown() is True and record(etcd_client, run.keys).reason == closed.reason  # the first reason stays


def test_a_settings_error_found_only_at_shutdown_still_closes_with_its_message(run, etcd_client, monkeypatch):
    # --max-restarts=0 and a worker that exited before its agent looked: torchrun only shuts down.
    a, b = run(1, 2, "10.0.0.1"), run(1, 2, "10.0.0.2")
    join_all(a, b)
    report_as_worker_of(a, monkeypatch)
    assert a.shutdown() is True
    assert record(etcd_client, run.keys).reason.endswith(SETTINGS_ERROR)
    wait_for(lambda: b.num_nodes_waiting() == 1, 30, what="the closed rendezvous to reach the other node")
    with pytest.raises(InvalidSettingsError, match="did you mean train.max_steps"):
        b.next_rendezvous()


def test_an_ordinary_close_does_not_end_the_other_nodes_groups(run):
    a, b = run(1, 2, "10.0.0.1"), run(1, 2, "10.0.0.2")
    join_all(a, b)
    assert a.shutdown() is True  # a's job finished: b's workers finish on their own
    b._joiner.view.refresh()
    assert b.num_nodes_waiting() == 0


def test_the_settings_error_directory_is_exported_to_the_workers_and_removed_when_the_node_leaves(run):
    handler = run(1, 1, "10.0.0.1")
    directory = handler.settings_error_dir
    assert os.path.isdir(directory)
    assert (os.environ[ENV_SETTINGS_ERROR_DIR], os.environ[ENV_AGENT_PID]) == (directory, str(os.getpid()))
    handler.leave()
    assert not os.path.exists(directory)
    assert ENV_SETTINGS_ERROR_DIR not in os.environ and ENV_AGENT_PID not in os.environ


def test_the_join_timeout_fails_the_join_and_withdraws_the_registration(run, etcd_client):
    lonely = run(2, 2, "10.0.0.1", join_timeout="2")
    with pytest.raises(RendezvousTimeoutError, match=r"join timeout \(2 s\)"):
        lonely.next_rendezvous()
    assert etcd_client.range(Range.prefix(run.keys.base + "joins/", count_only=True)).count == 0


def test_a_completed_round_writes_nothing_while_its_nodes_stay_alive(run, tmp_path):
    with EtcdServer(tmp_path / "etcd") as own, EtcdClient(own.endpoint) as client:  # no other writer
        handlers = [run(3, 3, f"10.0.0.{i}", endpoint=own.endpoint) for i in range(3)]
        join_all(*handlers)
        before = client.range(Range(run.keys.round)).revision
        stop = threading.Event()
        # Three lease TTLs of an agent's monitor loop: every node renewed its lease meanwhile.
        for _ in range(60):
            assert [h.num_nodes_waiting() for h in handlers] == [0, 0, 0]
            stop.wait(0.1)
        assert client.range(Range(run.keys.round)).revision == before  # not one write
        assert all(client.lease_ttl(h._joiner._lease.current) > 0 for h in handlers)
        for handler in handlers:
            handler.leave()


def test_round_numbers_keep_growing_when_a_runs_keys_were_deleted(run, etcd_client):
    join_all(run(1, 1, "10.0.0.1"))
    first = record(etcd_client, run.keys).round
    etcd_client.delete_prefix(run.keys.base)  # as if the run's lease had expired
    join_all(run(1, 1, "10.0.0.2"))
    assert record(etcd_client, run.keys).round > first


def test_a_corrupt_round_record_is_reported_naming_the_key(run, etcd_client):
    etcd_client.put(run.keys.round, b"garbage")
    with pytest.raises(RendezvousStateError, match="round.*is corrupt"):
        run(1, 1, "10.0.0.1").next_rendezvous()


def test_registrations_beyond_max_nodes_are_spares_and_their_leaving_changes_nothing(run, etcd_client):
    a = Joining(run(2, 2, "10.0.0.2"))
    wait_for(lambda: etcd_client.range(Range.prefix(run.keys.base + "joins/", count_only=True)).count == 1, 30,
             what="the first registration")  # fmt: skip
    # Another registration slips in before the round completes; it sorts before the late node's.
    round_ = record(etcd_client, run.keys).round
    lease = etcd_client.grant_lease(30)
    etcd_client.put(run.keys.join(round_, node_key("10.0.0.25", 1, 0)), "early", lease=lease)
    late = run(2, 2, "10.0.0.3")
    b = Joining(late)  # the third registration for a round of at most 2: it completes the round
    assert ranks([a.result()]) == [(0, 2)]
    assert b.thread.is_alive(), "the third registration by key order must wait as a spare"
    late.leave()  # a spare leaving is no membership change
    with pytest.raises(RendezvousClosedError, match="has left"):
        b.result()
    a.handler._joiner.view.wait(a.handler._joiner.view.snapshot().version, 1.0)
    assert a.handler.num_nodes_waiting() == 0
    etcd_client.revoke_lease(lease)  # a member leaving is one
    wait_for(lambda: a.handler.num_nodes_waiting() == 1, 30, what="the member's departure")


def test_membership_survives_an_etcd_outage_longer_than_the_lease(run, tmp_path):
    with EtcdServer(tmp_path / "etcd") as own:
        a, b = run(1, 2, "10.0.0.1", endpoint=own.endpoint), run(1, 2, "10.0.0.2", endpoint=own.endpoint)
        join_all(a, b)
        own.stop()
        stop = threading.Event()
        for _ in range(30):  # 3 s: longer than the lease TTL (2 s) without a single renewal
            assert (a.num_nodes_waiting(), b.num_nodes_waiting()) == (0, 0)
            stop.wait(0.1)
        own.start()
        # etcd gives every lease its full TTL when it is back; the nodes renew within a period.
        for _ in range(30):
            assert (a.num_nodes_waiting(), b.num_nodes_waiting()) == (0, 0)
            stop.wait(0.1)
        with EtcdClient(own.endpoint) as client:
            assert client.range(Range.prefix(run.keys.base + "joins/", count_only=True)).count == 2
        a.leave(), b.leave()


def test_a_join_rides_out_etcd_being_down_and_completes_once_it_is_back(run, tmp_path, monkeypatch):
    with EtcdServer(tmp_path / "etcd") as own:
        a = run(2, 2, "10.0.0.1", endpoint=own.endpoint, read_timeout="1")
        b = run(2, 2, "10.0.0.2", endpoint=own.endpoint, read_timeout="1")
        failed = record_raises(monkeypatch, a._joiner, "_join_step", EtcdConnectionError)
        own.stop()
        first = Joining(a)  # its first requests fail: etcd is not there
        wait_for(lambda: len(failed) >= 2, 30, what="two join steps that etcd did not answer")
        assert first.thread.is_alive() and first.error is None
        own.start()
        second = Joining(b)
        assert ranks([first.result(), second.result()]) == [(0, 2), (1, 2)]
        a.leave(), b.leave()


# -- releasing what a node holds (torch's launcher tests run many agents in one process) --------


def node_leases(client: EtcdClient, keys: RunKeys) -> dict[str, set[int]]:
    """The leases of the run's registration keys ("node") and store keys ("store")."""
    found = {"node": set(), "store": set()}
    for kv in client.get_prefix(keys.base):
        key = kv.key.decode()
        kind = "node" if key.startswith(keys.base + "joins/") else "store" if key.startswith(keys.store) else None
        if kind is not None and kv.lease:
            found[kind].add(kv.lease)
    return found


def threads_since(before: set[threading.Thread]) -> list[str]:
    # The deadline watchdog is one thread per process, shared by every keep-alive ever made.
    return [t.name for t in threading.enumerate() if t not in before and t.name != "etcd-deadline-watchdog"]


@pytest.mark.parametrize("end", ["leave", "shutdown"])
def test_a_node_that_ran_alone_releases_its_threads_and_leases_when_it_ends(end, run, etcd_client):
    before = set(threading.enumerate())
    handler = run(1, 1, "10.0.0.1")
    join_all(handler)  # rank 0 publishes its address in the store, under the store's lease
    leases = node_leases(etcd_client, run.keys)
    assert len(leases["node"]) == 1 and len(leases["store"]) == 1
    getattr(handler, end)()
    assert all(etcd_client.lease_ttl(lease) == -1 for lease in leases["node"] | leases["store"])
    assert etcd_client.get_prefix(run.keys.store) == []
    wait_for(lambda: not threads_since(before), 10, what=f"no thread left, found {threads_since(before)}")


def test_shutdown_leaves_the_store_lease_to_expire_while_other_nodes_may_be_in_the_exit_barrier(run, etcd_client):
    before = set(threading.enumerate())
    a, b = run(2, 2, "10.0.0.1"), run(2, 2, "10.0.0.2")
    join_all(a, b)
    store_leases = node_leases(etcd_client, run.keys)["store"]  # a's: rank 0 wrote the round's address
    assert len(store_leases) == 1
    ttl_before = etcd_client.lease_ttl(*store_leases)
    assert a.shutdown() is True
    # b may still wait for barrier keys a wrote: they stay, but nothing keeps them alive any more.
    assert etcd_client.get_prefix(run.keys.store) != []
    b.leave()
    wait_for(lambda: not threads_since(before), 10, what=f"no thread left, found {threads_since(before)}")
    assert 0 < etcd_client.lease_ttl(*store_leases) <= ttl_before


def test_leaving_while_etcd_is_unreachable_returns_promptly_and_lets_the_leases_expire(run, tmp_path):
    before = set(threading.enumerate())
    with EtcdServer(tmp_path / "etcd") as own:
        handler = run(1, 1, "10.0.0.1", endpoint=own.endpoint, read_timeout="2")
        join_all(handler)
        own.stop()
        start = time.monotonic()
        handler.leave()
        # One revocation that fails (read_timeout) and none after it; generous for a busy machine.
        assert time.monotonic() - start < 15
        wait_for(lambda: not threads_since(before), 10, what=f"no thread left, found {threads_since(before)}")
