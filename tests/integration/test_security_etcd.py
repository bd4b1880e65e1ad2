"""etcd over mutual TLS with auth on: the right credentials work, wrong ones fail fast and say why.

One real etcd per module: an https client URL with a server certificate for 127.0.0.1/localhost
from a throwaway CA (``trustme``), ``--client-cert-auth``, and auth enabled with a ``root`` user
and a job user whose role may only read and write under the job's key prefix. The job user's
password reaches the plugin only through ``ELASTIC_DDP_ETCD_PASSWORD``.

The failure tests bound the time to the error generously (a correctness bound: the failure is
not retried until ``join_timeout``, 600 s by default); they measured well under a second at the
backend and a few seconds of interpreter start-up through torchrun.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters

from elastic_ddp.tools.etcd_server import EtcdServer
from elastic_ddp.rendezvous import plugin
from elastic_ddp.etcd import EtcdAuthError, EtcdClient, EtcdConnectionError
from tests.helpers.nodes import start_node

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "workers" / "rdzv_worker.py"

JOB_USER, JOB_PASSWORD = "job-secure", "job-secret-pw"
ROOT_PASSWORD = "root-secret-pw"
JOB_PREFIX = "/jobs/secure"  # the job user's role covers "/jobs/secure/" only
FAIL_FAST_S = 30  # generous correctness bound; join_timeout (600 s) is what a retry loop would take

WRONG_CA = r"TLS handshake failed: certificate verify failed"
NO_CLIENT_CERT = r"TLS handshake failed: the server rejected the client certificate"
WRONG_PASSWORD = r"authentication failed, invalid user ID or password"


@dataclass(frozen=True)
class Pki:
    ca: str  # signs the server and client certificates; etcd trusts it for client certificates
    other_ca: str  # an unrelated CA: the "wrong CA"
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    # etcd takes a client certificate's CN as the user name for requests without a token; this
    # CN is no etcd user, so every request below is authorised by the password's token.
    client = ca.issue_cert("elastic-ddp-client")
    files = {
        "ca": ca.cert_pem, "other_ca": other.cert_pem,
        "server_cert": server.cert_chain_pems[0], "server_key": server.private_key_pem,
        "client_cert": client.cert_chain_pems[0], "client_key": client.private_key_pem,
    }  # fmt: skip
    for name, blob in files.items():
        blob.write_to_path(d / f"{name}.pem")
    return Pki(**{name: str(d / f"{name}.pem") for name in files})


def _etcdctl(server: EtcdServer, pki: Pki, *args: str, stdin: str | None = None) -> str:
    cmd = [
        "etcdctl", f"--endpoints={server.client_url}",
        f"--cacert={pki.ca}", f"--cert={pki.client_cert}", f"--key={pki.client_key}", *args,
    ]  # fmt: skip
    result = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, f"{' '.join(args[:2])}: {result.stderr}"
    return result.stdout


def _start_secure_etcd(data_dir: Path, pki: Pki, extra_args: tuple[str, ...] = ()) -> EtcdServer:
    server = EtcdServer(
        data_dir,
        cert_file=pki.server_cert,
        key_file=pki.server_key,
        trusted_ca_file=pki.ca,
        client_cert_auth=True,
        extra_args=extra_args,
    ).start(timeout=30)
    try:
        _etcdctl(server, pki, "user", "add", "root", f"--new-user-password={ROOT_PASSWORD}")
        _etcdctl(server, pki, "user", "grant-role", "root", "root")
        _etcdctl(server, pki, "role", "add", "job-secure")
        _etcdctl(server, pki, "role", "grant-permission", "job-secure", "--prefix=true", "readwrite", f"{JOB_PREFIX}/")
        _etcdctl(server, pki, "user", "add", JOB_USER, f"--new-user-password={JOB_PASSWORD}")
        _etcdctl(server, pki, "user", "grant-role", JOB_USER, "job-secure")
        _etcdctl(server, pki, "auth", "enable")
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="module")
def secure_etcd(tmp_path_factory, pki):
    server = _start_secure_etcd(tmp_path_factory.mktemp("secure-etcd"), pki)
    try:
        yield server
    finally:
        server.stop()


def _conf(pki: Pki, *, ca: str | None = None, client_cert: bool = True, prefix: str = JOB_PREFIX) -> dict[str, str]:
    conf = {"protocol": "https", "cacert": ca or pki.ca, "user": JOB_USER, "etcd_prefix": prefix}
    if client_cert:
        conf |= {"cert": pki.client_cert, "key": pki.client_key}
    return conf


def _params(endpoint: str, run_id: str, **conf) -> RendezvousParameters:
    return RendezvousParameters(backend="etcd", endpoint=endpoint, run_id=run_id, min_nodes=1, max_nodes=1, **conf)


# -- backend and client -------------------------------------------------------------------------


def test_state_round_trips_over_mutual_tls_as_a_prefix_limited_user(secure_etcd, pki, monkeypatch):
    monkeypatch.setenv(plugin.PASSWORD_ENV, JOB_PASSWORD)
    backend, store = plugin.create_backend(_params(secure_etcd.endpoint, uuid.uuid4().hex, **_conf(pki)))
    try:
        assert backend.get_state() is None
        state, token, written = backend.set_state(b"first")
        assert (state, written) == (b"first", True)
        assert backend.set_state(b"second", token)[:3:2] == (b"second", True)
        assert backend.get_state()[0] == b"second"
        assert backend.set_state(b"stale", token)[::2] == (b"second", False)  # the old token loses
        store.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        store.close()


def test_a_user_outside_its_role_prefix_is_refused_at_once_as_an_auth_error(secure_etcd, pki, monkeypatch):
    monkeypatch.setenv(plugin.PASSWORD_ENV, JOB_PASSWORD)
    backend, store = plugin.create_backend(_params(secure_etcd.endpoint, "run", **_conf(pki, prefix="/jobs/other")))
    try:
        start = time.monotonic()
        with pytest.raises(RendezvousConnectionError, match="permission denied") as info:
            backend.set_state(b"x")
        assert time.monotonic() - start < FAIL_FAST_S
        assert isinstance(info.value.__cause__, EtcdAuthError)
    finally:
        store.close()


def test_the_handler_forms_a_round_over_mutual_tls_as_a_prefix_limited_user(secure_etcd, pki, monkeypatch):
    monkeypatch.setenv(plugin.PASSWORD_ENV, JOB_PASSWORD)
    monkeypatch.setenv(plugin.DISABLE_SHARED_STORE_ENV, "1")
    run_id = uuid.uuid4().hex
    handler = plugin.create_rdzv_handler(_params(secure_etcd.endpoint, run_id, **_conf(pki)))
    try:
        info = handler.next_rendezvous()  # leases, transactions, watches and the store, all as the job user
        assert (info.rank, info.world_size) == (0, 1)
        assert handler.num_nodes_waiting() == 0
    finally:
        assert handler.shutdown() is True
    client = EtcdClient(secure_etcd.endpoint, timeout=5, user=JOB_USER, password=JOB_PASSWORD,
                        ca_cert=pki.ca, cert=pki.client_cert, key=pki.client_key)  # fmt: skip
    try:
        assert b'"closed":true' in client.get(f"{JOB_PREFIX}/{run_id}/round").value
    finally:
        client.close()


def test_the_handler_outside_its_role_prefix_is_refused_as_a_connection_error(secure_etcd, pki, monkeypatch):
    monkeypatch.setenv(plugin.PASSWORD_ENV, JOB_PASSWORD)
    handler = plugin.create_rdzv_handler(_params(secure_etcd.endpoint, "run", **_conf(pki, prefix="/jobs/other")))
    try:
        start = time.monotonic()
        with pytest.raises(RendezvousConnectionError, match="permission denied") as info:
            handler.next_rendezvous()
        assert time.monotonic() - start < FAIL_FAST_S
        assert isinstance(info.value.__cause__, EtcdAuthError)
    finally:
        handler.leave()


@pytest.mark.parametrize(
    ("case", "message", "cause"),
    [
        ("wrong_ca", WRONG_CA, EtcdConnectionError),
        ("no_client_cert", NO_CLIENT_CERT, EtcdConnectionError),
        ("wrong_password", WRONG_PASSWORD, EtcdAuthError),
    ],
)
def test_bad_credentials_fail_fast_naming_the_problem(case, message, cause, secure_etcd, pki, monkeypatch):
    monkeypatch.setenv(plugin.PASSWORD_ENV, "not-the-password" if case == "wrong_password" else JOB_PASSWORD)
    conf = _conf(pki, ca=pki.other_ca if case == "wrong_ca" else None, client_cert=case != "no_client_cert")
    start = time.monotonic()
    # With a user the plugin authenticates while creating the client, so the error comes here.
    with pytest.raises(RendezvousConnectionError, match=message) as info:
        plugin.create_backend(_params(secure_etcd.endpoint, "run", **conf))
    elapsed = time.monotonic() - start
    assert elapsed < FAIL_FAST_S, f"{case} took {elapsed:.1f} s"
    assert type(info.value.__cause__) is cause
    assert secure_etcd.endpoint in str(info.value)


def test_an_expired_token_is_renewed_and_a_changed_password_then_fails_as_auth_error(tmp_path, pki):
    # --auth-token-ttl=1: the token expires after 1 s without requests. etcd's token keeper
    # checks once a second, so waiting 3 s is what it takes; there is nothing to poll.
    with _start_secure_etcd(tmp_path / "etcd", pki, extra_args=("--auth-token-ttl=1",)) as server:
        tls = {"ca_cert": pki.ca, "cert": pki.client_cert, "key": pki.client_key}
        client = EtcdClient(server.endpoint, timeout=5, user=JOB_USER, password=JOB_PASSWORD, **tls)
        try:
            client.put(f"{JOB_PREFIX}/k", "1")
            time.sleep(3)
            client.put(f"{JOB_PREFIX}/k", "2")  # re-authenticates once, then succeeds
            assert client.get(f"{JOB_PREFIX}/k").value == b"2"

            root = f"--user=root:{ROOT_PASSWORD}"
            _etcdctl(server, pki, root, "user", "passwd", JOB_USER, "--interactive=false", stdin="rotated\n")
            time.sleep(3)
            with pytest.raises(EtcdAuthError, match=WRONG_PASSWORD):
                client.get(f"{JOB_PREFIX}/k")
        finally:
            client.close()


# -- torchrun end to end ------------------------------------------------------------------------


def _torchrun(endpoint: str, run_id: str, conf: dict[str, str]) -> list[str]:
    rdzv_conf = ",".join(f"{k}={v}" for k, v in conf.items())
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes=1", "--nproc-per-node=1", "--max-restarts=0",
        "--rdzv-backend=etcd", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
        f"--rdzv-conf={rdzv_conf}", "--monitor-interval=0.1", str(WORKER),
    ]  # fmt: skip


def _env(password: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", plugin.PASSWORD_ENV: password}
    env.pop(plugin.TORCH_ETCD_ENV, None)
    return env


@pytest.mark.slow
def test_torchrun_rendezvous_over_mutual_tls_with_auth_exits_zero(secure_etcd, pki, tmp_path):
    cmd = _torchrun(secure_etcd.endpoint, f"tls-{uuid.uuid4().hex[:8]}", _conf(pki))
    with start_node(cmd, _env(JOB_PASSWORD), tmp_path / "node.log") as node:
        code = node.wait(timeout=120)
        out = node.output()
    assert code == 0, out
    assert "RDZV_WORKER rank=0 world_size=1 sum=1" in out, out
    assert JOB_PASSWORD not in out  # the password is in the environment only, never logged


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "message"),
    [("wrong_ca", WRONG_CA), ("no_client_cert", NO_CLIENT_CERT), ("wrong_password", WRONG_PASSWORD)],
)
def test_torchrun_with_bad_credentials_exits_fast_naming_the_problem(case, message, secure_etcd, pki, tmp_path):
    conf = _conf(pki, ca=pki.other_ca if case == "wrong_ca" else None, client_cert=case != "no_client_cert")
    password = "not-the-password" if case == "wrong_password" else JOB_PASSWORD
    cmd = _torchrun(secure_etcd.endpoint, f"bad-{case}", conf)  # join_timeout: torch's 600 s
    start = time.monotonic()
    with start_node(cmd, _env(password), tmp_path / "node.log") as node:
        code = node.wait(timeout=120)
        elapsed = time.monotonic() - start
        out = node.output()
    assert code != 0, out
    assert elapsed < FAIL_FAST_S, f"{case} took {elapsed:.1f} s:\n{out}"
    assert message in out, out
    assert "RDZV_WORKER" not in out
    print(f"{case}: torchrun exited {code} after {elapsed:.2f} s")
