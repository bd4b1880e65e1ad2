"""deploy/slurm/train.sbatch on a real Slurm: submitted, preempted, timed out, requeued and resumed.

One Slurm cluster per module on this machine (tests/helpers/slurm.py: munged, slurmctld and two
slurmds, "n1" and "n2", each a node of 2 CPUs; partitions ``train`` and ``urgent`` with
``PreemptMode=REQUEUE``), a TLS etcd with auth on and the script's default user, and the session's
S3 API server holding the script's default checkpoint bucket. The script itself is submitted
with sbatch, with only what this cluster needs changed: 2 CPUs a node and no GPUs on the sbatch
command line, one worker per node (``GPUS_PER_NODE=1``), the tiny model, a ledger and run
directory under the test's tmp dir. Its secrets come from the files it reads under ``$HOME``
(a tmp dir), its etcd client certificate from ``$HOME/.elastic-ddp/etcd-tls``, its checkpoints go to
its default ``s3://elastic-ddp-checkpoints/runs/slurm-$SLURM_JOB_ID``.

What each test shows comes from the run's ledger (every step each rank trained, each attempt's
resume step) and from ``scontrol show job`` (the same job id, ``Restarts=N``, the final state);
sacct would need slurmdbd.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme

from elastic_ddp.checkpoint.manager import list_checkpoints
from elastic_ddp.checkpoint.manifest import MANIFEST_NAME, check_signature
from elastic_ddp.checkpoint.storage import Storage
from elastic_ddp.data import read_ledger
from elastic_ddp.tools.etcd_server import EtcdServer
from tests.fixtures.s3 import MotoServer
from tests.helpers.job import RESUMED_LINE, TINY, steps
from tests.helpers.nodes import wait_for
from tests.helpers.slurm import SlurmCluster

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "deploy" / "slurm" / "train.sbatch"

# The script's defaults, which the tests keep: its etcd user, its checkpoint bucket; and the
# rendezvous plugin's default key prefix, which that user's role covers.
ETCD_USER = "elastic-ddp"
ETCD_PREFIX = "/elastic_ddp/rendezvous/"
CHECKPOINT_BUCKET = "elastic-ddp-checkpoints"
ETCD_PASSWORD = "slurm-job-etcd-pw"
CHECKPOINT_KEY = "slurm-test-signing-key"
# What this cluster needs changed on the sbatch command line: its nodes have 2 CPUs and no GPUs.
CPU_NODES = ["--cpus-per-task=2", "--gpus-per-node=0"]


# ---------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    # KillWait 15 s: what `scontrol requeue` gives the (tiny) stop checkpoint before its SIGKILL.
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"), kill_wait_s=15).start()
    try:
        yield cluster
    finally:
        cluster.stop()
    assert not cluster.processes(), "processes of the Slurm cluster outlived it"


@dataclass(frozen=True)
class SecureEtcd:
    server: EtcdServer
    files: dict[str, str]  # ca.crt, tls.crt, tls.key: the client's, as ETCD_TLS_DIR holds them


def _etcdctl(server: EtcdServer, certs: dict[str, str], *args: str) -> None:
    cmd = [
        "etcdctl", f"--endpoints={server.client_url}", f"--cacert={certs['ca.crt']}",
        f"--cert={certs['tls.crt']}", f"--key={certs['tls.key']}", *args,
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, f"etcdctl {' '.join(args[:2])}: {result.stderr}"


@pytest.fixture(scope="module")
def secure_etcd(tmp_path_factory):
    """etcd over mutual TLS with auth on; the script's user may read and write the rendezvous prefix only."""
    d = tmp_path_factory.mktemp("etcd-pki")
    ca = trustme.CA()
    server_cert, client = ca.issue_cert("127.0.0.1", "localhost"), ca.issue_cert("elastic-ddp-client")
    ca.cert_pem.write_to_path(d / "ca.crt")
    server_cert.cert_chain_pems[0].write_to_path(d / "server.crt")
    server_cert.private_key_pem.write_to_path(d / "server.key")
    client.cert_chain_pems[0].write_to_path(d / "tls.crt")
    client.private_key_pem.write_to_path(d / "tls.key")
    certs = {name: str(d / name) for name in ("ca.crt", "tls.crt", "tls.key")}
    server = EtcdServer(
        tmp_path_factory.mktemp("etcd-data"), cert_file=str(d / "server.crt"), key_file=str(d / "server.key"),
        trusted_ca_file=certs["ca.crt"], client_cert_auth=True,
    ).start(timeout=30)  # fmt: skip
    try:
        _etcdctl(server, certs, "user", "add", "root", "--new-user-password=root-pw")
        _etcdctl(server, certs, "user", "grant-role", "root", "root")
        _etcdctl(server, certs, "role", "add", "training")
        _etcdctl(server, certs, "role", "grant-permission", "training", "--prefix=true", "readwrite", ETCD_PREFIX)
        _etcdctl(server, certs, "user", "add", ETCD_USER, f"--new-user-password={ETCD_PASSWORD}")
        _etcdctl(server, certs, "user", "grant-role", ETCD_USER, "training")
        _etcdctl(server, certs, "auth", "enable")
        yield SecureEtcd(server, certs)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def checkpoint_bucket(s3_server: MotoServer) -> str:
    import boto3

    client = boto3.client("s3", endpoint_url=s3_server.moto_endpoint, region_name=os.environ["AWS_DEFAULT_REGION"])
    client.create_bucket(Bucket=CHECKPOINT_BUCKET)
    return CHECKPOINT_BUCKET


@pytest.fixture
def home(tmp_path, secure_etcd) -> Path:
    """A $HOME as the script expects it: the etcd password, the checkpoint key and the etcd client
    certificate in ~/.elastic-ddp, readable only by the user."""
    home = tmp_path / "home"
    tls = home / ".elastic-ddp" / "etcd-tls"
    tls.mkdir(parents=True)
    for name, source in secure_etcd.files.items():
        (tls / name).write_bytes(Path(source).read_bytes())
    for path, text in ((tls / "tls.key", None), (home / ".elastic-ddp" / "etcd-password", ETCD_PASSWORD),
                       (home / ".elastic-ddp" / "checkpoint-key", CHECKPOINT_KEY)):  # fmt: skip
        if text is not None:
            path.write_text(text + "\n")
        path.chmod(0o600)
    return home


# ---------------------------------------------------------------------------------------------
# A submitted train.sbatch


@dataclass
class TrainJob:
    cluster: SlurmCluster
    job_id: int
    output: Path  # the job's --output file (every run of it appends)
    run_dir: Path  # the run's directory (ledger, TensorBoard defaults): <run.root>/slurm-<job id>

    def text(self) -> str:
        try:
            return self.output.read_text(errors="replace")
        except OSError:
            return ""

    def info(self) -> dict[str, str]:
        return self.cluster.job(self.job_id)

    def wait_until(self, predicate, timeout: float, what: str):
        try:
            return wait_for(predicate, timeout, interval=0.2, what=what)
        except TimeoutError as exc:
            raise AssertionError(
                f"{exc}\n--- job {self.job_id}: {self.info()}\n--- its output ---\n{self.text()[-6000:]}"
            ) from None

    def wait_for_step(self, step: int, timeout: float = 120, after: int = 0) -> None:
        """Wait until the output shows step ``step`` (past the first ``after`` characters)."""
        self.wait_until(lambda: any(s >= step for s, _ in steps(self.text()[after:])), timeout, f"step {step}")

    def wait_for_state(self, *states: str, timeout: float) -> dict[str, str]:
        fields = self.wait_until(lambda: (f := self.info()).get("JobState") in states and f, timeout,
                                 f"job state {'/'.join(states)}")  # fmt: skip
        return fields


def submit(
    slurm: SlurmCluster, home: Path, etcd: SecureEtcd, tmp_path: Path, *, sbatch_flags=(), flags=(), env=None
) -> TrainJob:
    """sbatch deploy/slurm/train.sbatch from the checkout, as a user would (see its header)."""
    job_env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # torchrun of this interpreter
        "HOME": str(home),
        "ETCD_ENDPOINT": etcd.server.endpoint,
        "GPUS_PER_NODE": "1",  # workers per node: one per CPU node here
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    output = tmp_path / "slurm-%j.out"
    job_id = slurm.sbatch(
        *CPU_NODES, f"--output={output}", *sbatch_flags, str(SBATCH),
        f"--run.root={tmp_path / 'runs'}", "--data.ledger=true", f"--checkpoint.memory_dir={tmp_path / 'memory'}",
        *TINY, *flags, env=job_env, cwd=REPO,
    )  # fmt: skip
    run_dir = tmp_path / "runs" / f"slurm-{job_id}"  # the run is named after torchrun's --rdzv-id
    return TrainJob(slurm, job_id, Path(str(output).replace("%j", str(job_id))), run_dir)


def attempts(run_dir: Path, rank: int = 0) -> list[tuple[int, list[int]]]:
    """(resume step, steps trained) of each attempt, as rank ``rank``'s ledger file lists them: the steps
    whose end (their loss) it recorded."""
    found: list[tuple[int, list[int]]] = []
    for line in (run_dir / "ledger" / f"rank-{rank}.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "attempt" in record:
            found.append((record["resume_step"], []))
        elif "loss" in record:
            found[-1][1].append(record["step"])
    return found


# ---------------------------------------------------------------------------------------------
# Tests


@pytest.fixture
def cluster(slurm):
    """The module's cluster, emptied after the test: every job killed, every node idle."""
    try:
        yield slurm
    finally:
        slurm.cancel_all()


def _resumes(text: str) -> list[int]:
    return [int(m[2]) for m in RESUMED_LINE.finditer(text)]


def assert_each_attempt_resumed_where_the_last_stopped(run_dir: Path, n: int, max_steps: int | None) -> list[int]:
    """The ledger's attempts: ``n`` of them, the first from scratch, each later one from the last step
    of the one before (0 steps redone), each training consecutive steps; the whole history is steps
    1.. once each (to ``max_steps`` when given). Returns the steps each attempt stopped at."""
    found = attempts(run_dir)
    assert len(found) == n, [(resume, trained[:1] + trained[-1:]) for resume, trained in found]
    ends = []
    for index, (resume, trained) in enumerate(found):
        assert resume == (ends[-1] if ends else 0), f"attempt {index} resumed from step {resume}, not {ends[-1:]}"
        assert trained == list(range(resume + 1, resume + 1 + len(trained))), f"attempt {index} skipped a step"
        assert trained, f"attempt {index} trained no step"
        ends.append(trained[-1])
    history = read_ledger(run_dir)
    assert sorted(history) == list(range(1, ends[-1] + 1))
    if max_steps is not None:
        assert ends[-1] == max_steps
    return ends


def test_sigterm_to_the_batch_shell_commits_requeues_once_and_resumes_with_no_step_redone(
    cluster, home, secure_etcd, checkpoint_bucket, tmp_path
):
    max_steps = 600  # a few seconds of steps: the requeued run finishes them
    # No checkpoint but the stop's and the final one: the resume can only be from the stop checkpoint.
    flags = [f"--train.max_steps={max_steps}", "--checkpoint.every_steps=0"]
    job = submit(cluster, home, secure_etcd, tmp_path, flags=flags)
    job.wait_for_step(20)
    # SIGTERM to the batch shell, as the time-limit warning (--signal=B:TERM) sends it; the script's trap
    # passes it to the steps. (Without --batch scancel signals only the steps; see deploy/README.md.)
    cluster.command("scancel", "--batch", "--signal=TERM", str(job.job_id))
    done = job.wait_for_state("COMPLETED", "FAILED", "CANCELLED", timeout=180)
    text = job.text()
    assert (done["JobState"], done["Restarts"], done["ExitCode"]) == ("COMPLETED", "1", "0:0"), (done, text[-4000:])
    stopped, _ = assert_each_attempt_resumed_where_the_last_stopped(job.run_dir, 2, max_steps)
    assert 20 <= stopped < max_steps
    assert _resumes(text) == [stopped], text[-4000:]  # from the stop checkpoint, in the requeued run
    assert text.count(f"requeueing job {job.job_id}") == 1
    assert f"job {job.job_id} (restart 1)" in text
    # The stop checkpoint and the final one, at the script's default URL, signed with the key it read from ~.
    storage = Storage(f"s3://{checkpoint_bucket}/runs/slurm-{job.job_id}")
    infos = list_checkpoints(storage)
    assert [info.step for info in infos][-2:] == [stopped, max_steps]
    for info in infos:
        manifest = json.loads(storage.read_bytes(f"{info.url}/{MANIFEST_NAME}"))
        assert "signature" in manifest
        check_signature(manifest, CHECKPOINT_KEY.encode(), info.url)
    report(job, "scancel --batch --signal=TERM")


def test_preemption_and_scontrol_requeue_each_resume_with_no_step_redone(
    cluster, home, secure_etcd, checkpoint_bucket, tmp_path
):
    max_steps = 2000  # more than trains while Slurm preempts (a fast attempt reached 800 first)
    flags = [f"--train.max_steps={max_steps}", "--checkpoint.every_steps=0"]
    job = submit(cluster, home, secure_etcd, tmp_path, flags=flags)
    job.wait_for_step(20)
    # A job of the higher-priority partition needs a node: Slurm preempts the training job
    # (PreemptMode=REQUEUE, GraceTime): SIGTERM to its steps, not to its batch shell.
    urgent = cluster.sbatch(
        "--partition=urgent", "--nodes=1", "--cpus-per-task=2", f"--output={tmp_path}/urgent.out", "--wrap=sleep 1"
    )
    job.wait_until(lambda: job.info()["Restarts"] == "1" and len(_resumes(job.text())) == 1, 120,
                   "the preempted job to run again and resume")  # fmt: skip
    assert cluster.job(urgent)["JobState"] == "COMPLETED"
    mark = len(job.text())
    job.wait_for_step(_resumes(job.text())[0] + 20, after=mark)
    # An administrator's requeue: SIGTERM to every process of the job, KillWait, SIGKILL; Slurm requeues it.
    cluster.command("scontrol", "requeue", str(job.job_id))
    done = job.wait_for_state("COMPLETED", "FAILED", "CANCELLED", timeout=180)
    text = job.text()
    assert (done["JobState"], done["Restarts"], done["ExitCode"]) == ("COMPLETED", "2", "0:0"), (done, text[-4000:])
    preempted, requeued, _ = assert_each_attempt_resumed_where_the_last_stopped(job.run_dir, 3, max_steps)
    assert _resumes(text) == [preempted, requeued], text[-4000:]
    report(job, "preemption, then scontrol requeue")


def test_time_limit_warning_commits_a_checkpoint_and_the_requeued_run_resumes(
    cluster, home, secure_etcd, checkpoint_bucket, tmp_path
):
    # --time=1 with the warning 5 s before the end: Slurm checks time limits every 30 s and sends the
    # warning up to 30 s early, so it comes 25 to 55 s after the start, well after the first step.
    job = submit(cluster, home, secure_etcd, tmp_path, sbatch_flags=["--nodes=1", "--time=1", "--signal=B:TERM@5"],
                 flags=["--train.max_steps=1000000", "--checkpoint.every_steps=0"])  # fmt: skip
    job.wait_until(lambda: len(_resumes(job.text())) == 1, 150, "the requeued run to resume")
    text = job.text()
    assert job.info()["Restarts"] == "1"
    assert "SIGTERM: asking the agents to checkpoint and stop" in text
    cluster.command("scancel", str(job.job_id))  # a cancel: the script must not requeue the job
    assert job.wait_for_state("CANCELLED", timeout=90)["Restarts"] == "1"
    found = attempts(job.run_dir)
    (first_resume, first), (resumed, second) = found[:2]
    assert first_resume == 0 and first and resumed == first[-1] == _resumes(text)[0]
    report(job, "time limit (--time=1 --signal=B:TERM@5)")


def test_an_agent_killed_inside_the_allocation_does_not_end_the_job(
    cluster, home, secure_etcd, checkpoint_bucket, tmp_path
):
    # Two slurmds on one host: the agent on n2 and its worker SIGKILLed stand for n2 failing.
    max_steps = 300
    flags = [f"--train.max_steps={max_steps}", "--checkpoint.every_steps=10"]
    job = submit(cluster, home, secure_etcd, tmp_path, flags=flags)
    job.wait_for_step(30)
    assert job.info()["NodeList"] == "n[1-2]"
    victims = cluster.job_processes(job.job_id, node="n2")  # the agent on n2 and its worker
    assert len(victims) >= 2, victims
    for pid in victims:
        os.kill(pid, 9)
    done = job.wait_for_state("COMPLETED", "FAILED", "CANCELLED", timeout=180)
    text = job.text()
    assert done["Restarts"] == "0", (done, text[-4000:])  # the same run of the job went on, not a requeue
    history = read_ledger(job.run_dir)
    assert sorted(history) == list(range(1, max_steps + 1)), text[-4000:]
    assert history[max_steps].world_size == 1 and history[1].world_size == 2
    # srun returns the worst task's status, the killed agent's: the job is FAILED though the run finished.
    assert (done["JobState"], done["ExitCode"]) == ("FAILED", "137:0"), done
    report(job, f"agent on n2 killed (job ended {done['JobState']}, exit {done['ExitCode']})")


def report(job: TrainJob, what: str) -> None:
    """One line for the log: the job's end and each attempt's (resume step, [first, last step])."""
    info = job.info()
    spans = [(resume, trained[:1] + trained[-1:]) for resume, trained in attempts(job.run_dir)]
    print(f"SLURM {what}: job {job.job_id} {info.get('JobState')} Restarts={info.get('Restarts')}; attempts {spans}")

