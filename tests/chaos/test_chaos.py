"""Chaos suite: what real clusters do to an elastic job, with real torchrun agents, etcd and storage.

A "node" is one torchrun agent with its worker. Every scenario prints its measured recovery time
and lost steps (``RELIABILITY {...}`` lines; ``python benchmarks/reliability.py`` collects them
into docs/reliability.md). No timing is asserted: this machine is shared and noisy.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from elastic_ddp.tools import checkpoint as ckpt_cli
from tests.helpers.job import Job, report, resumed_steps, steps

pytestmark = pytest.mark.slow

ENDLESS = "--train.max_steps=100000"
COMMITTED_LINE = re.compile(r"Checkpoint committed at (\S+):")


@pytest.fixture
def job(etcd_endpoint, tmp_path):
    created: list[Job] = []

    def make(**kwargs) -> Job:
        kwargs.setdefault("endpoint", etcd_endpoint)
        created.append(Job(root=tmp_path, **kwargs))
        return created[-1]

    try:
        yield make
    finally:
        for each in created:
            each.cleanup()


def test_preempted_node_checkpoints_and_survivors_continue_with_zero_lost_steps(job):
    j = job(flags=[ENDLESS, "--checkpoint.every_steps=1000", "--data.ledger=true"])
    j.add_node(), j.add_node()  # the survivors
    preempted = j.add_node()
    j.wait_for_step(5, world_size=3)
    mark, t0 = j.mark(), time.monotonic()
    preempted.terminate()  # what Kubernetes and Slurm send
    recovery_s = j.wait_for_training_since(mark, t0, world_size=2)
    after = j.output_since(mark)
    last_before = max(s for s, w in steps(j.output()) if w == 3)
    resumed = resumed_steps(after)
    assert resumed, after[-4000:]
    # The stop checkpoint is of the last step trained at world size 3: nothing is redone.
    assert resumed[-1] == last_before, after[-4000:]
    # The preempted node left the round once that checkpoint was committed, not once its agent exited.
    assert re.search(r"left the rendezvous '\S+' as its stop checkpoint was committed", preempted.output()), after[-4000:]
    # A membership change, not a failure: the survivors' agents spent none of --max-restarts.
    assert j.restarts() == 0
    assert any(start["world_size"] == 2 for start in j.worker_starts())
    preempted.wait(timeout=60)
    report("preemption (SIGTERM to one node)", "stop checkpoint at the agreed step; survivors restart at world size 2",
           round(recovery_s, 1), last_before - resumed[-1], checkpoints_verified=j.stop_and_verify_checkpoints())


def test_node_joining_costs_no_progress(job):
    j = job(flags=[ENDLESS, "--checkpoint.every_steps=1000", "--data.ledger=true"])
    j.add_node(), j.add_node()
    j.wait_for_step(5, world_size=2)
    mark, t0 = j.mark(), time.monotonic()
    j.add_node()
    recovery_s = j.wait_for_training_since(mark, t0, world_size=3)
    after = j.output_since(mark)
    last_before = max(s for s, w in steps(j.output()) if w == 2)
    resumed = resumed_steps(after)
    assert resumed and resumed[-1] == last_before, after[-4000:]
    assert j.restarts() == 0  # membership changes spend no restarts
    report("node joins", "stop checkpoint at the agreed step; all restart at world size 3",
           round(recovery_s, 1), last_before - resumed[-1], checkpoints_verified=j.stop_and_verify_checkpoints())


def test_hard_node_loss_survivor_resumes_from_newest_checkpoint(job):
    every = 5
    j = job(flags=[ENDLESS, f"--checkpoint.every_steps={every}"])
    j.add_node()
    victim = j.add_node()
    j.wait_for_step(12, world_size=2)
    j.wait_for_commit()
    mark, t0 = j.mark(), time.monotonic()
    victim.kill()  # SIGKILL of the agent and its workers: no chance to checkpoint
    recovery_s = j.wait_for_training_since(mark, t0, world_size=1)
    last_before = max(s for s, w in steps(j.output()) if w == 2)
    resumed = resumed_steps(j.output_since(mark))
    assert resumed, j.output_since(mark)[-4000:]
    lost = last_before - resumed[-1]
    # The save of step N runs in the background while steps N+1.. train, and the save of step
    # N+every waits for it: the newest committed checkpoint is at most two intervals old.
    assert 0 <= lost < 2 * every
    report("hard node loss (SIGKILL of a node)", "survivor resumes from the newest committed checkpoint",
           round(recovery_s, 1), lost, checkpoint_every=every,
           checkpoints_verified=j.stop_and_verify_checkpoints())


def test_orphaned_workers_exit_by_themselves_when_their_agent_dies(job):
    from tests.helpers.nodes import descendants, wait_for

    # A lost agent gets no stop checkpoint: the survivor resumes from a periodic one.
    j = job(flags=[ENDLESS, "--checkpoint.every_steps=5"])
    j.add_node()
    victim = j.add_node()
    j.wait_for_step(12, world_size=2)
    j.wait_for_commit()
    workers = descendants(victim.pid)
    assert workers
    # Marked before the kill: the survivor may resume before the orphans are seen gone.
    mark, t0 = j.mark(), time.monotonic()
    victim.process.kill()  # only the agent: its workers are in a session of their own

    def all_gone() -> bool:
        return all(not _alive(pid) for pid in workers)

    wait_for(all_gone, 30, what="the orphaned workers to exit")
    exit_s = time.monotonic() - t0
    recovery_s = j.wait_for_training_since(mark, t0, world_size=1)
    report("orphaned workers (agent SIGKILLed alone)", "workers notice the lost parent and exit",
           round(exit_s, 1), None, survivor_training_again_s=round(recovery_s, 1),
           checkpoints_verified=j.stop_and_verify_checkpoints())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[-1][0] != "Z"
    except OSError:
        return False


def test_worker_exception_restarts_the_group_which_resumes(job):
    j = job(flags=[ENDLESS, "--checkpoint.every_steps=5", "--data.ledger=true"],
            extra_env={"ELASTIC_DDP_FAULT": "raise@12:rank=1:restart=0"})
    j.add_node(), j.add_node()
    j.wait_for_step(11, world_size=2)
    mark, t0 = j.mark(), time.monotonic()
    j.wait_until(lambda: "InjectedFault" in j.output(), 120, "the injected failure")
    recovery_s = j.wait_for_training_since(mark, t0, world_size=2)
    resumed = resumed_steps(j.output_since(mark))
    assert resumed and resumed[-1] <= 11
    assert j.restarts() == 1  # a failure spends one of --max-restarts
    j.wait_for_step(14, world_size=2)
    report("worker crash (exception, once)", "group restarts and resumes from the newest checkpoint",
           round(recovery_s, 1), 11 - resumed[-1], checkpoints_verified=j.stop_and_verify_checkpoints())


def test_crash_recurring_at_the_same_step_stops_after_the_budget_with_one_clear_error(job):
    j = job(
        nnodes="1", flags=[ENDLESS, "--checkpoint.every_steps=5"],
        extra_env={"ELASTIC_DDP_FAULT": "raise@8:rank=0"}, torchrun_flags=["--max-restarts=2"],
    )  # fmt: skip
    node = j.add_node()
    code = node.wait(timeout=240)
    output = node.output()
    assert code != 0
    # Every attempt resumed from step 5 and died at step 8: three attempts for --max-restarts=2.
    assert output.count("InjectedFault: injected failure at step 8") >= 3
    assert "RecurringFailureError: Step 8 failed in all 3 attempts with the same error" in output
    assert "--max-restarts=2 is spent" in output
    report("worker crash recurring at the same step", "stops after --max-restarts with one clear final error",
           None, None, checkpoints_verified=j.stop_and_verify_checkpoints(require_any=False))  # the crash at step 8 may beat step 5's save


def test_frozen_rank_is_detected_within_the_collective_timeout_and_the_group_recovers(job):
    import os
    import signal

    from tests.helpers.nodes import worker_pids

    timeout_s = 10
    # Saves every 5 steps of a few ms are nearly always in flight: a survivor's next save waits for the one
    # the frozen rank never finishes, whose collectives wait for it up to checkpoint.timeout_s (600 s by
    # default, for peers writing large states to slow storage). So both timeouts are the test's.
    j = job(flags=[ENDLESS, "--checkpoint.every_steps=5", f"--dist.timeout_s={timeout_s}",
                   f"--checkpoint.timeout_s={timeout_s}"])  # fmt: skip
    j.add_node()
    frozen_node = j.add_node()
    j.wait_for_step(8, world_size=2)
    # Frozen only once a checkpoint is committed, for the group to resume from.
    j.wait_for_commit()
    [worker] = worker_pids(frozen_node.pid)
    mark, t0 = j.mark(), time.monotonic()
    os.kill(worker, signal.SIGSTOP)  # a rank that stops making progress without dying
    j.wait_until(lambda: "Traceback" in j.output_since(mark), 2 * timeout_s + 60, "the hang to be detected")
    detected_s = time.monotonic() - t0
    recovery_s = j.wait_for_training_since(mark, t0, world_size=2, timeout=180)
    resumed = resumed_steps(j.output_since(mark))
    assert resumed
    # The frozen worker ignores SIGTERM: torchrun's restart path waits a fixed 30 s before SIGKILL.
    report("hang (SIGSTOP of one rank)", f"collective timeout ({timeout_s} s) breaks the group; it re-forms",
           round(recovery_s, 1), None, detected_s=round(detected_s, 1), dist_timeout_s=timeout_s,
           checkpoints_verified=j.stop_and_verify_checkpoints())


def test_a_dead_node_whose_workers_hang_in_a_collective_is_noticed_in_moments_not_after_the_timeout(job):
    import os
    import signal

    from tests.helpers.nodes import descendants

    # Collectives that would wait 300 s for the dead node: only its agent's silence can tell.
    j = job(flags=[ENDLESS, "--checkpoint.every_steps=5", "--dist.timeout_s=300"])
    j.add_node(), j.add_node()
    victim = j.add_node()
    j.wait_for_step(8, world_size=3)
    j.wait_for_commit()
    workers = descendants(victim.pid)
    mark, t0 = j.mark(), time.monotonic()
    # Its workers hold their connections open and never answer (as NCCL may hang on a dead peer);
    # its agent dies.
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    victim.process.kill()
    try:
        recovery_s = j.wait_for_training_since(mark, t0, world_size=2, timeout=120)
    finally:
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    after = j.output_since(mark)
    # Its predecessor in the ring found its agent gone; the survivors' ranks, stuck in a collective
    # with the dead, left on their agents' signal within a second instead of torchrun's 30 s.
    assert "refuses connections (its agent is gone)" in after, after[-4000:]
    assert "waits on a peer that is gone" in after, after[-4000:]
    report("dead node, its workers hung (agent SIGKILLed, workers SIGSTOPped)",
           "ring probe removes it; survivors' ranks leave their collective on the restart", round(recovery_s, 1), None,
           dist_timeout_s=300, checkpoints_verified=j.stop_and_verify_checkpoints())  # fmt: skip


@pytest.fixture
def own_etcd(tmp_path):
    """An etcd of this test alone (it is stopped and killed on purpose)."""
    from elastic_ddp.tools.etcd_server import EtcdServer

    server = EtcdServer(tmp_path / "own-etcd")
    server.start(timeout=30)
    try:
        yield server
    finally:
        server.stop()


def test_training_goes_on_through_a_30_s_etcd_outage_and_membership_changes_after_it(job, own_etcd):
    j = job(endpoint=own_etcd.endpoint, flags=[ENDLESS, "--checkpoint.every_steps=1000", "--data.ledger=true"])
    j.add_node(), j.add_node()
    j.wait_for_step(5, world_size=2)
    own_etcd.stop()
    down_at = j.last_step()
    time.sleep(30)
    during = j.last_step()
    own_etcd.start(timeout=30)
    # Heartbeats could not be written for 30 s; nobody may be declared dead for that.
    time.sleep(6)
    assert during > down_at + 5, "training stalled while etcd was down"
    assert j.restarts() == 0
    assert resumed_steps(j.output()) == [], "the workers were restarted because of the outage"
    mark, t0 = j.mark(), time.monotonic()
    j.add_node()
    recovery_s = j.wait_for_training_since(mark, t0, world_size=3)
    report("etcd outage (30 s) during training", "training goes on; a node joins after etcd is back",
           0.0, 0, steps_during_outage=during - down_at, join_after_outage_s=round(recovery_s, 1),
           checkpoints_verified=j.stop_and_verify_checkpoints())


def test_rendezvous_continues_through_a_3_member_etcd_cluster_with_one_member_killed(job, tmp_path):
    from elastic_ddp.tools.etcd_server import EtcdCluster

    cluster = EtcdCluster(tmp_path / "cluster", n=3).start()
    try:
        j = job(endpoint=cluster.endpoints, flags=[ENDLESS, "--checkpoint.every_steps=1000"])
        j.add_node(), j.add_node()
        j.wait_for_step(5, world_size=2)
        cluster.members[0].kill()  # the first endpoint every client tries
        mark, t0 = j.mark(), time.monotonic()
        j.add_node()
        recovery_s = j.wait_for_training_since(mark, t0, world_size=3)
        report("etcd member lost (3-member cluster)", "rendezvous fails over to the other members; a node joins",
               round(recovery_s, 1), 0, checkpoints_verified=j.stop_and_verify_checkpoints())
    finally:
        cluster.stop()


def _leader(cluster) -> int:
    """Index of the member that leads ``cluster`` now (asked through etcd's HTTP gateway)."""
    import urllib.request

    for index, member in enumerate(cluster.members):
        if not member.running:
            continue
        request = urllib.request.Request(f"{member.client_url}/v3/maintenance/status", data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=5) as response:
            status = json.loads(response.read())
        # A member that knows no leader (an election in progress) omits the field.
        if status.get("leader") and status["leader"] == status["header"]["member_id"]:
            return index
    raise AssertionError("no etcd member says it is the leader")


def test_an_etcd_leader_election_during_training_drops_no_node_and_restarts_no_worker(job, tmp_path):
    from elastic_ddp.tools.etcd_server import EtcdCluster
    from elastic_ddp.rendezvous.plugin import DEFAULT_KEEP_ALIVE_INTERVAL, DEFAULT_KEEP_ALIVE_MAX_ATTEMPT

    ttl = DEFAULT_KEEP_ALIVE_INTERVAL * DEFAULT_KEEP_ALIVE_MAX_ATTEMPT
    cluster = EtcdCluster(tmp_path / "cluster", n=3).start()
    try:
        j = job(endpoint=cluster.endpoints, flags=[ENDLESS, "--checkpoint.every_steps=1000", "--data.ledger=true"])
        j.add_node(), j.add_node()
        j.wait_for_step(5, world_size=2)
        leader = _leader(cluster)
        mark, before, started = j.mark(), j.last_step(), len(j.worker_starts())
        t0 = time.monotonic()
        cluster.members[leader].kill()  # no renewal is answered until the others elect a new leader
        new_leader = _leader_after(cluster, t0)
        elected_s = time.monotonic() - t0
        time.sleep(3 * ttl)  # three lease TTLs: a node whose lease lapsed would be gone by now
        during = j.last_step()
        after = j.output_since(mark)
        assert during > before + 5, "training stalled during the election"
        assert len(j.worker_starts()) == started, after[-4000:]  # no node left or joined: no worker started
        assert j.restarts() == 0
        assert resumed_steps(j.output()) == [], "the workers were restarted because of the election"
        report("etcd leader killed (3-member cluster)", "a new leader is elected; no node is dropped, no worker restarts",
               0.0, 0, leader_elected_s=round(elected_s, 1), new_leader=f"etcd{new_leader}", lease_ttl_s=ttl,
               steps_during=during - before, checkpoints_verified=j.stop_and_verify_checkpoints(require_any=False))
    finally:
        cluster.stop()


def _leader_after(cluster, since: float) -> int:
    from tests.helpers.nodes import wait_for

    def elected():
        try:
            return _leader(cluster) + 1  # truthy for index 0
        except (AssertionError, OSError, ValueError):
            return 0

    return wait_for(elected, 30, what="a new etcd leader") - 1


def test_storage_outage_during_an_async_save_fails_that_save_and_a_later_one_succeeds(job, s3_server, s3_url):
    j = job(nnodes="1", flags=[ENDLESS, "--checkpoint.every_steps=20", "--checkpoint.keep_last=1000", f"--checkpoint.url={s3_url}"])
    node = j.add_node()
    j.wait_until(lambda: "Checkpoint committed" in node.output(), 180, "a first committed checkpoint on S3")
    mark = j.mark()
    s3_server.stop()
    before_outage = COMMITTED_LINE.findall(node.output())[-1]
    try:
        j.wait_until(lambda: "failed" in j.output_since(mark) and "checkpoint of step" in j.output_since(mark),
                     180, "a save to fail while S3 is down")  # fmt: skip
        failed_at = j.last_step()
        j.wait_for_step(failed_at + 5)  # training goes on
    finally:
        s3_server.start()
    after = j.mark()
    j.wait_until(lambda: "Checkpoint committed" in j.output_since(after), 180, "a save to succeed after S3 is back")
    assert ckpt_cli.main(["ckpt", "verify", before_outage]) == 0  # the newest one before the outage is intact
    report("storage outage (S3 down during an async save)",
           "that save fails and is reported; training goes on; the next save commits", None, 0,
           checkpoints_verified=j.stop_and_verify_checkpoints(s3_url))


class Link:
    """A veth pair between this network namespace ("A" side) and a namespace of its own ("B" side)."""

    def __init__(self) -> None:
        import random
        import uuid

        tag = uuid.uuid4().hex[:6]
        self.netns, self.veth_a, self.veth_b = f"eddp-{tag}", f"ed{tag}a", f"ed{tag}b"
        subnet = f"10.{random.randint(100, 250)}.{random.randint(0, 255)}"
        # B's address sorts first, so B's agent gets group rank 0 (torch sorts nodes by address).
        self.addr_b, self.addr_a = f"{subnet}.1", f"{subnet}.2"
        self._ip("netns", "add", self.netns)
        self._ip("link", "add", self.veth_a, "type", "veth", "peer", "name", self.veth_b)
        self._ip("link", "set", self.veth_b, "netns", self.netns)
        self._ip("addr", "add", f"{self.addr_a}/24", "dev", self.veth_a)
        self._ip("link", "set", self.veth_a, "up")
        for args in (("addr", "add", f"{self.addr_b}/24", "dev", self.veth_b), ("link", "set", self.veth_b, "up"),
                     ("link", "set", "lo", "up")):  # fmt: skip
            self._ip("-n", self.netns, *args)

    @staticmethod
    def _ip(*args: str) -> None:
        import subprocess

        subprocess.run(["ip", *args], check=True, capture_output=True)

    def prefix_b(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns]

    def cut(self) -> None:
        self._ip("link", "set", self.veth_a, "down")

    def heal(self) -> None:
        self._ip("link", "set", self.veth_a, "up")

    def remove(self) -> None:
        import subprocess

        subprocess.run(["ip", "netns", "delete", self.netns], capture_output=True)
        subprocess.run(["ip", "link", "delete", self.veth_a], capture_output=True)


@pytest.fixture
def link():
    import os
    import shutil

    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2 (CI runs as root)")
    made = Link()
    try:
        yield made
    finally:
        made.remove()


def test_partitioned_node_is_replaced_and_cannot_commit_as_a_stale_writer(job, link, tmp_path):
    """Node B is cut off, not killed, with a save of step 10 gathered but not yet committed and its
    training thread stuck (so nothing makes it exit). A recovers alone; B's late commit is fenced."""
    from elastic_ddp.tools.etcd_server import EtcdServer

    every, timeout_s = 10, 10
    etcd = EtcdServer(tmp_path / "etcd-on-link", host=link.addr_a)
    etcd.start(timeout=30)
    release = tmp_path / "release-the-stale-commit"
    try:
        j = job(endpoint=etcd.endpoint, flags=[ENDLESS, f"--checkpoint.every_steps={every}", f"--dist.timeout_s={timeout_s}"])
        node_b = j.add_node(
            command_prefix=link.prefix_b(),
            torchrun_flags=[f"--local-addr={link.addr_b}"],
            extra_env={"GLOO_SOCKET_IFNAME": link.veth_b,
                       "ELASTIC_DDP_FAULT": f"wait@before_manifest:rank=0:until={release},hang@{every + 1}:rank=0:restart=0"},
        )  # fmt: skip
        node_a = j.add_node(torchrun_flags=[f"--local-addr={link.addr_a}"], extra_env={"GLOO_SOCKET_IFNAME": link.veth_a})
        j.wait_until(lambda: "holding this save" in node_b.output(), 180, "B to hold its save of step 10")
        assert "Rank 0 of world size 2" in node_b.output()
        mark, t0 = j.mark(), time.monotonic()
        link.cut()
        step_dir = j.run_dir / "checkpoints" / f"step-{every:09d}"
        # A detects the loss when B's lease ends (B cannot renew it) or after dist.timeout_s, re-forms
        # alone and saves step 10 itself.
        j.wait_until(lambda: any(w == 1 for _, w in steps(j.output_since(mark))), 180, "A to train alone")
        recovery_s = time.monotonic() - t0
        j.wait_until(lambda: f"Checkpoint committed at {step_dir}" in node_a.output(), 180, "A's commit of step 10")
        release.touch()  # B's save thread wakes and tries to commit into the run
        j.wait_until(lambda: "stale writer" in node_b.output(), 60, "B's refused commit")
        # Every committed checkpoint after the cut is A's (retention may have removed step 10 by now).
        # A keeps training and saving, so retention may remove a listed checkpoint at any moment; it
        # deletes the manifest first, so one that fails verification without it was removed, not damaged.
        for manifest_path in sorted((j.run_dir / "checkpoints").glob("step-*/manifest.json")):
            try:
                manifest = json.loads(manifest_path.read_text())
            except FileNotFoundError:
                continue
            assert manifest["step"] < every or (manifest["world_size"] == 1 and manifest["rdzv_round"] > 0), manifest
            verified = ckpt_cli.main(["ckpt", "verify", str(manifest_path.parent)])
            assert verified == 0 or not manifest_path.exists(), f"{manifest_path.parent} failed verification"
        heal_mark, t1 = j.mark(), time.monotonic()
        link.heal()
        rejoin_s = j.wait_for_training_since(heal_mark, t1, world_size=2)
        report("network partition (one node cut off)",
               "others re-form when its lease ends or after dist.timeout_s; its late commit is fenced; it rejoins on heal",
               round(recovery_s, 1), every, dist_timeout_s=timeout_s, rejoin_after_heal_s=round(rejoin_s, 1),
               checkpoints_verified=j.stop_and_verify_checkpoints())  # fmt: skip
    finally:
        for each in j.nodes if "j" in locals() else []:
            each.cleanup()
        etcd.stop()


def test_corrupt_newest_checkpoint_at_restart_falls_back_to_the_previous_one(job):
    first = job(nnodes="2", flags=["--train.max_steps=15", "--checkpoint.every_steps=5"])
    for node in (first.add_node(), first.add_node()):
        assert node.wait(timeout=180) == 0, first.output()[-4000:]
    newest = first.run_dir / "checkpoints" / f"step-{15:09d}"
    shard = sorted(newest.glob("shard-*.bin"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit: bit rot, a torn write
    shard.write_bytes(bytes(data))

    again = job(nnodes="2", run_id=first.run_id, rdzv_id=f"{first.run_id}-again", flags=["--train.max_steps=25", "--checkpoint.every_steps=5"])
    for node in (again.add_node(), again.add_node()):
        assert node.wait(timeout=180) == 0, again.output()[-4000:]
    out = again.output()
    assert f"Skipping checkpoint {newest}: file '{shard.name}' failed verification" in out, out[-4000:]
    assert resumed_steps(out) == [10], out[-4000:]
    assert f"Replacing {newest}, which failed verification" in out
    assert ckpt_cli.main(["ckpt", "verify", str(newest)]) == 0  # re-saved when training reached step 15 again
    report("corrupt newest checkpoint at restart", "verification skips it, resumes from the previous one, re-saves it",
           None, 15 - 10, checkpoints_verified=again.stop_and_verify_checkpoints())
