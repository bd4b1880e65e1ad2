"""A throwaway Slurm cluster on this machine, for tests: munged, slurmctld and one slurmd per node.

:class:`SlurmCluster` writes a slurm.conf under its own directory (state, spool, logs, pid files,
munge key and socket there too; free loopback ports for slurmctld and each slurmd) and starts the
daemons as its children. Its nodes are all this host, each a slurmd of its own (``slurmd -N``, a
``NodeName`` with its own ``Port`` and ``NodeHostname`` this host), so a job can span several
"nodes" and one of them can fail while the others go on.

The partitions model what a site configures for preemption (``PreemptType=preempt/partition_prio``,
``PreemptMode=REQUEUE``): ``train`` (the default) may be preempted after :attr:`grace_time_s`,
``urgent`` has the higher ``PriorityTier`` and preempts it.

Clean-up is by PID: slurmd starts each job step under a ``slurmstepd`` that leaves slurmd's process
tree (its parent becomes init), and torchrun's workers start sessions of their own; but every one of
them carries this cluster's ``SLURM_CONF`` in its environment (slurmd hands it to slurmstepd, which
hands it to the job). :meth:`SlurmCluster.stop` SIGKILLs the daemons, then every process whose
environment names this cluster's slurm.conf, until none is left.

Installing Slurm is ``deploy/local/install-slurm.sh`` (the test command runs it); :func:`ensure_installed`
runs it when a command is missing and this is root, and raises, saying what to do, otherwise.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.helpers.nodes import wait_for

__all__ = ["SlurmCluster", "ensure_installed"]

REPO = Path(__file__).resolve().parents[2]
INSTALL_SCRIPT = REPO / "deploy" / "local" / "install-slurm.sh"
COMMANDS = ("sbatch", "srun", "scontrol", "scancel", "squeue", "sinfo", "slurmctld", "slurmd", "munged", "mungekey")
# Job fields of `scontrol show job -o` (KEY=VALUE, space-separated; the values read here have no spaces).
_FIELD = re.compile(r"(?:^|\s)([A-Za-z][\w:/]*)=(\S*)")


def _missing() -> list[str]:
    return [name for name in COMMANDS if shutil.which(name) is None]


def ensure_installed() -> None:
    """Install Slurm with deploy/local/install-slurm.sh when a command is missing (root only).

    Raises:
        RuntimeError: Slurm is missing and cannot be installed here, with the script's reason.
    """
    missing = _missing()
    if not missing:
        return
    if os.geteuid() != 0:
        raise RuntimeError(
            f"Slurm is not installed ({', '.join(missing)} missing) and installing it needs root: run "
            f"{INSTALL_SCRIPT.relative_to(REPO)} as root (Debian/Ubuntu), or install slurmctld, slurmd, "
            "slurm-client and munge."
        )
    result = subprocess.run(
        ["bash", str(INSTALL_SCRIPT)], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900
    )
    if result.returncode != 0 or _missing():
        raise RuntimeError(
            f"{INSTALL_SCRIPT.relative_to(REPO)} could not install Slurm (exit {result.returncode}):\n"
            f"{(result.stdout + result.stderr)[-3000:]}"
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


class SlurmCluster:
    """munged, slurmctld and ``len(nodes)`` slurmds on this host, configured under ``root``.

    Args:
        root: an empty directory of the test's own (state, spool, logs, config).
        nodes: the node names; each is a slurmd of its own on this host.
        cpus: CPUs each node offers (a job asking for more per node stays pending).
        kill_wait_s: ``KillWait``: SIGTERM to SIGKILL when Slurm ends a job (time limit, requeue).
        grace_time_s: ``GraceTime`` of the ``train`` partition: SIGTERM to SIGKILL when preempted.
        cred_expire_s: ``cred_expire``: also how long a requeued job waits before it may start again.
    """

    def __init__(
        self, root: Path, nodes: Sequence[str] = ("n1", "n2"), *, cpus: int = 2, kill_wait_s: int = 30,
        grace_time_s: int = 60, cred_expire_s: int = 5,
    ) -> None:  # fmt: skip
        self.root = Path(root)
        self.nodes = tuple(nodes)
        self.cpus = cpus
        self.kill_wait_s = kill_wait_s
        self.grace_time_s = grace_time_s
        self.cred_expire_s = cred_expire_s
        self.conf = self.root / "slurm.conf"
        self.logs = self.root / "log"
        self._daemons: list[subprocess.Popen] = []
        self._munged: subprocess.Popen | None = None

    # --- start and stop -------------------------------------------------------------------------

    def start(self, timeout: float = 60) -> SlurmCluster:
        """Write the configuration, start munged, slurmctld and the slurmds; wait until every node is idle.

        Raises:
            RuntimeError: not root (slurmd starts jobs as their users), Slurm missing, or a daemon failed.
        """
        if os.geteuid() != 0:
            raise RuntimeError("A Slurm cluster needs root: slurmd starts every job as its user. Run the tests as root.")
        ensure_installed()
        try:
            self._write_config()
            self._start_munged()
            self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
            for node in self.nodes:
                self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
            wait_for(self._all_idle, timeout, interval=0.2, what=f"Slurm nodes {', '.join(self.nodes)} to be idle")
        except BaseException as exc:
            logs = self.daemon_logs()
            self.stop()
            if isinstance(exc, TimeoutError):
                raise RuntimeError(f"{exc}\n--- Slurm daemon logs ---\n{logs}") from None
            raise
        return self

    def stop(self) -> None:
        """SIGKILL the daemons, then every process of every job (safe to call more than once)."""
        for process in self._daemons:
            if process.poll() is None:
                process.kill()
        for process in self._daemons:
            process.wait()
        # Nothing can start new job processes now; freeze, then kill, whatever carries our SLURM_CONF
        # until none is left.
        def none_left() -> bool:
            pids = self.processes()
            for sig in (signal.SIGSTOP, signal.SIGKILL):
                for pid in pids:
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
            return not pids

        wait_for(none_left, 10, what="every process of the test cluster to be gone")
        if self._munged is not None and self._munged.poll() is None:
            self._munged.kill()
            self._munged.wait()
        self._munged = None
        self._daemons.clear()

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def processes(self) -> list[int]:
        """Every live process (not a zombie) whose environment names this cluster's slurm.conf."""
        marker = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid() and marker in _environ(int(entry)).split(b"\0"):
                found.append(int(entry))
        return found

    def job_processes(self, job_id: int, node: str | None = None) -> list[int]:
        """The processes of job ``job_id`` (on ``node`` only, if given): its scripts, tasks and workers."""
        wanted = [f"SLURM_JOB_ID={job_id}".encode()] + ([f"SLURMD_NODENAME={node}".encode()] if node else [])
        return [pid for pid in self.processes() if all(w in _environ(pid).split(b"\0") for w in wanted)]

    # --- client commands ------------------------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        """The environment a client command (sbatch, scontrol, ...) needs to find this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def command(self, *args: str, env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None) -> str:
        """Run a Slurm client command against this cluster; its stdout.

        Raises:
            RuntimeError: the command failed, with its output.
        """
        result = subprocess.run(
            list(args), env={**(env or os.environ), "SLURM_CONF": str(self.conf)}, cwd=cwd,
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if result.returncode != 0:
            output = result.stderr or result.stdout
            raise RuntimeError(f"`{' '.join(args)}` failed (exit {result.returncode}): {output}")
        return result.stdout

    def sbatch(self, *args: str, env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None) -> int:
        """Submit a batch job (``args``: sbatch options, the script, its arguments); the job id."""
        out = self.command("sbatch", "--parsable", *args, env=env, cwd=cwd)
        return int(out.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job -o``: JobState, Restarts, NodeList, ExitCode, ... (values without spaces)."""
        return dict(_FIELD.findall(self.command("scontrol", "show", "job", "-o", str(job_id))))

    def wait_for_state(self, job_id: int, states: Sequence[str], timeout: float) -> dict[str, str]:
        """Wait until the job's state is one of ``states``; its fields."""

        def reached() -> dict[str, str] | None:
            fields = self.job(job_id)
            return fields if fields.get("JobState") in states else None

        try:
            return wait_for(reached, timeout, interval=0.5, what=f"job {job_id} to be {'/'.join(states)}")
        except TimeoutError as exc:
            raise AssertionError(f"{exc} It is: {self.job(job_id)}") from None

    def cancel_all(self, timeout: float = 60) -> None:
        """SIGKILL every job (all its steps and its batch shell) and wait until every node is idle again."""
        jobs = self.command("squeue", "--noheader", "--format=%i").split()
        if jobs:
            # Running jobs die at once (a plain scancel would give them KillWait); then pending ones go.
            for args in (["--full", "--signal=KILL"], []):
                subprocess.run(["scancel", *args, *jobs], env=self.env, capture_output=True, timeout=60)
        wait_for(self._all_idle, timeout, interval=0.5, what="every Slurm node to be idle")

    def daemon_logs(self, tail: int = 3000) -> str:
        parts = []
        for path in sorted(self.logs.glob("*")):
            text = path.read_text(errors="replace")
            parts.append(f"== {path.name}\n{text[-tail:]}")
        return "\n".join(parts)

    # --- set-up ---------------------------------------------------------------------------------

    def _write_config(self) -> None:
        for sub in ("state", "log", "munge", *(f"spool/{node}" for node in self.nodes)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "munge").chmod(0o700)  # munged refuses a key or socket directory others can write
        host = socket.gethostname().split(".")[0]
        nodes = ",".join(self.nodes)
        lines = [
            f"ClusterName=edptest{random.randrange(10**6)}",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.root / 'munge' / 'munge.socket'},cred_expire={self.cred_expire_s}",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool'}/%n",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={self.logs / 'slurmctld.log'}",
            f"SlurmdLogFile={self.logs / 'slurmd-%n.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "MailProg=/bin/true",
            # No cgroups here: processes are tracked by parentage, tasks not bound, nothing accounted.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "SchedulerType=sched/builtin",
            # Look at pending jobs every 2 s (default 60), so a requeued job starts as soon as it may.
            "SchedulerParameters=sched_interval=2",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "ReturnToService=2",
            # Job ids of their own, so a session's S3 keys and rendezvous ids named after them never repeat.
            f"FirstJobId={random.randrange(10**5, 10**6)}",
            f"KillWait={self.kill_wait_s}",
            "MinJobAge=600",
            "PreemptType=preempt/partition_prio",
            "PreemptMode=REQUEUE",
        ]  # fmt: skip
        for node in self.nodes:
            lines.append(
                f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={_free_port()} CPUs={self.cpus} "
                "State=UNKNOWN"
            )
        lines += [
            f"PartitionName=train Nodes={nodes} Default=YES MaxTime=INFINITE State=UP PriorityTier=1 "
            f"PreemptMode=REQUEUE GraceTime={self.grace_time_s}",
            f"PartitionName=urgent Nodes={nodes} MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF",
        ]  # fmt: skip
        self.conf.write_text("\n".join(lines) + "\n")

    def _start_munged(self) -> None:
        munge = self.root / "munge"
        subprocess.run(["mungekey", "--create", f"--keyfile={munge / 'munge.key'}"], check=True, capture_output=True)
        self._munged = subprocess.Popen(
            ["munged", "--foreground", "--force", f"--key-file={munge / 'munge.key'}",
             f"--socket={munge / 'munge.socket'}", f"--pid-file={munge / 'munged.pid'}",
             f"--log-file={self.logs / 'munged.log'}", f"--seed-file={munge / 'munged.seed'}"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_for(lambda: (munge / "munge.socket").exists() or self._munged.poll() is not None, 10, what="munged")
        if self._munged.poll() is not None:
            raise RuntimeError(f"munged exited with {self._munged.returncode}: {self.daemon_logs()}")

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.logs / f"{name}.out", "ab")
        try:
            process = subprocess.Popen(
                cmd, env={**os.environ, "SLURM_CONF": str(self.conf)}, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        finally:
            log.close()
        self._daemons.append(process)

    def _all_idle(self) -> bool:
        for process in self._daemons:
            if process.poll() is not None:
                raise RuntimeError(f"{process.args[0]} exited with {process.returncode}:\n{self.daemon_logs()}")
        try:
            out = self.command("sinfo", "--noheader", "--Node", "--format=%N %t")
        except RuntimeError:
            return False
        states = dict(line.split() for line in out.splitlines() if line.strip())
        return all(states.get(node) == "idle" for node in self.nodes)
