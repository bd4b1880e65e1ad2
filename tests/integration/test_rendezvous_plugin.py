"""rdzv_conf parsing, torchrun registry override, lazy imports and end-to-end torchrun runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters

from elastic_ddp.tools.etcd_server import free_port
from elastic_ddp.rendezvous import plugin
from elastic_ddp.etcd import EtcdConnectionError
from elastic_ddp.worker.stop import ENV_SETTINGS_ERROR_DIR
from tests.helpers.nodes import start_node, wait_for

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "workers" / "rdzv_worker.py"


def params(endpoint: str = "127.0.0.1:2379", **conf) -> RendezvousParameters:
    return RendezvousParameters(backend="etcd-v3", endpoint=endpoint, run_id="run", min_nodes=1, max_nodes=1, **conf)


# -- rdzv_conf -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("conf", "attribute", "expected"),
    [
        ({"read_timeout": "3"}, "timeout", 3.0),
        ({}, "timeout", float(plugin.DEFAULT_READ_TIMEOUT)),
    ],
)
def test_read_timeout_is_parsed(conf, attribute, expected):
    client = plugin.create_client(params(**conf))
    try:
        assert getattr(client, attribute) == expected
    finally:
        client.close()


def test_endpoint_list_gets_the_default_port():
    client = plugin.create_client(params("a,b:1234"))
    try:
        assert client.endpoints == ["a:2379", "b:1234"]
    finally:
        client.close()


@pytest.mark.parametrize("alias", ["etcd_prefix", "key_prefix"])
def test_key_prefix_aliases(alias, etcd_endpoint):
    backend, store = plugin.create_backend(params(etcd_endpoint, **{alias: "/custom/"}))
    assert backend.key == "/custom/run/state"
    assert store.prefix == "/custom/run/store/"
    store.close()


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ({"protocol": "ftp"}, r"'protocol' \('ftp'\) must be 'http' or 'https'"),
        ({"read_timeout": "soon"}, r"'read_timeout' \('soon'\) must be a positive number"),
        ({"read_timeout": "0"}, r"'read_timeout' \('0'\)"),
        ({"protocol": "https", "cacert": "/no/such/file"}, r"'cacert' \('/no/such/file'\) is not a readable file"),
        ({"ca_cert": __file__}, r"'ca_cert' .* needs protocol=https"),
        ({"etcd_prefix": "relative"}, r"'etcd_prefix' \('relative'\) must be an absolute"),
        ({"key_prefix": "/a", "etcd_prefix": "/b"}, r"same setting with different values"),
        ({"read_timout": "3"}, r"'read_timout'.*not known"),
        ({"protocol": "https", "cert": __file__}, r"must be given together"),
    ],
)
def test_bad_rdzv_conf_values_raise_value_error_naming_them(conf, message):
    with pytest.raises(ValueError, match=message):
        plugin.create_client(params(**conf))


def test_bad_endpoint_port_is_named():
    with pytest.raises(ValueError, match=r"'h:port'.*invalid port 'port'"):
        plugin.create_client(params("h:port"))


def test_password_in_rdzv_conf_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=f"not accepted.*{plugin.PASSWORD_ENV}"):
        plugin.create_client(params(user="u", password="secret"))


def test_user_without_password_env_is_refused(monkeypatch):
    monkeypatch.delenv(plugin.PASSWORD_ENV, raising=False)
    with pytest.raises(ValueError, match=plugin.PASSWORD_ENV):
        plugin.create_client(params(user="u"))


def test_password_is_read_from_the_environment(monkeypatch, tmp_path):
    """With auth enabled in a dedicated etcd, the env password authenticates and a wrong one fails."""
    from elastic_ddp.tools.etcd_server import EtcdServer
    from elastic_ddp.etcd import EtcdAuthError, EtcdClient

    with EtcdServer(tmp_path / "etcd") as server:
        root = EtcdClient(server.endpoint)
        raw = root._raw  # test setup only: enable auth with the underlying client's RPCs
        import etcd3.etcdrpc as rpc

        raw.authstub.UserAdd(rpc.AuthUserAddRequest(name="root", password="rootpw"), 5)
        raw.authstub.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"), 5)
        raw.authstub.AuthEnable(rpc.AuthEnableRequest(), 5)
        root.close()

        monkeypatch.setenv(plugin.PASSWORD_ENV, "rootpw")
        backend, store = plugin.create_backend(params(server.endpoint, user="root"))
        assert backend.set_state(b"x")[2] is True
        store.close()

        monkeypatch.setenv(plugin.PASSWORD_ENV, "wrong")
        with pytest.raises(Exception) as info:
            plugin.create_backend(params(server.endpoint, user="root"))
        assert isinstance(info.value.__cause__, EtcdAuthError)
        assert "root" in str(info.value)


@pytest.mark.parametrize("create", [plugin.create_backend, plugin.create_rdzv_handler], ids=["backend", "handler"])
def test_creating_it_with_no_etcd_listening_fails_at_once_naming_the_endpoint(create, monkeypatch):
    endpoint = f"127.0.0.1:{free_port()}"  # bound once, then closed: nobody listens there
    monkeypatch.delenv(ENV_SETTINGS_ERROR_DIR, raising=False)
    start = time.monotonic()
    with pytest.raises(RendezvousConnectionError) as raised:
        create(params(endpoint, read_timeout="5"))
    assert time.monotonic() - start < 15  # a refused connection fails in ~1.5 s; the bound is read_timeout
    message = str(raised.value)
    assert f"expected an etcd v3 server accepting its requests at --rdzv-endpoint '{endpoint}'" in message
    assert f"etcd at {endpoint} is unavailable" in message
    assert isinstance(raised.value.__cause__, EtcdConnectionError)
    assert ENV_SETTINGS_ERROR_DIR not in os.environ  # nothing was set up for a handler that does not exist


def test_recovery_defaults_are_injected_but_user_values_win():
    merged = plugin._with_recovery_defaults(params(last_call_timeout="7"))
    assert merged.get_as_int("last_call_timeout") == 7
    assert merged.get_as_int("keep_alive_interval") == plugin.DEFAULT_KEEP_ALIVE_INTERVAL
    assert merged.get_as_int("keep_alive_max_attempt") == plugin.DEFAULT_KEEP_ALIVE_MAX_ATTEMPT
    assert merged.get_as_int("heartbeat_timeout") == plugin.DEFAULT_HEARTBEAT_TIMEOUT


def test_handler_is_created_with_the_recovery_defaults(etcd_endpoint, monkeypatch):
    monkeypatch.setenv(plugin.DISABLE_SHARED_STORE_ENV, "1")
    handler = plugin.create_rdzv_handler(params(etcd_endpoint))
    try:
        settings = handler.settings
        assert handler.get_backend() == "etcd-v3"
        assert settings.keep_alive_interval == plugin.DEFAULT_KEEP_ALIVE_INTERVAL
        assert settings.lease_ttl == plugin.DEFAULT_KEEP_ALIVE_INTERVAL * plugin.DEFAULT_KEEP_ALIVE_MAX_ATTEMPT
        assert settings.last_call_timeout == plugin.DEFAULT_LAST_CALL_TIMEOUT
        assert settings.join_timeout == 600 and settings.run_ttl == plugin.DEFAULT_RUN_TTL
        assert settings.keep_alive_deadline == settings.lease_ttl / 2  # capped: half the lease TTL
    finally:
        handler.leave()


def test_keep_alive_options_set_the_lease_ttl_as_torchs_heartbeat_options_did():
    settings = plugin.handler_settings(
        plugin._with_recovery_defaults(params(keep_alive_interval="2", keep_alive_max_attempt="4", heartbeat="3"))
    )
    assert (settings.keep_alive_interval, settings.lease_ttl, settings.keep_alive_deadline) == (2, 8, 3.0)


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ({"keep_alive_interval": "0"}, r"'keep_alive_interval' \('0'\) must be a positive whole number"),
        ({"last_call_timeout": "soon"}, r"'last_call_timeout' \('soon'\)"),
        ({"keep_alive_interval": "2", "keep_alive_max_attempt": "1"}, r"lease TTL \(2 s"),
    ],
)
def test_bad_handler_options_raise_value_error_naming_them(conf, message):
    with pytest.raises(ValueError, match=message):
        plugin.handler_settings(plugin._with_recovery_defaults(params(**conf)))


# -- registry and imports (fresh interpreters, so torch's registration runs as in torchrun) ------


def _python(code: str, **env) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


_SHOW_REGISTRY = (
    "import torch.distributed.elastic.rendezvous\n"
    "from elastic_ddp.rendezvous.plugin import _torch_handler_registry\n"
    "r = _torch_handler_registry()\n"
    "print(r['etcd'].__module__ + '.' + r['etcd'].__name__, r['etcd-v3'].__name__)\n"
)


def test_torch_registry_still_has_the_private_dict_this_plugin_edits():
    # If this fails, torch changed RendezvousHandlerRegistry: etcd_handler() must be revisited.
    from torch.distributed.elastic.rendezvous.api import RendezvousHandlerRegistry, rendezvous_handler_registry

    assert isinstance(rendezvous_handler_registry, RendezvousHandlerRegistry)
    assert isinstance(plugin._torch_handler_registry(), dict)
    assert {"etcd", "etcd-v2", "c10d", "static"} <= set(plugin._torch_handler_registry())


def test_etcd_backend_name_is_served_by_this_plugin():
    assert _python(_SHOW_REGISTRY, **{plugin.TORCH_ETCD_ENV: "0"}) == (
        "elastic_ddp.rendezvous.plugin.create_rdzv_handler create_rdzv_handler"
    )


def test_torch_etcd_env_var_gives_torchs_own_handler_back():
    out = _python(_SHOW_REGISTRY, **{plugin.TORCH_ETCD_ENV: "1"})
    assert out.startswith("torch.distributed.elastic.rendezvous.registry._create_etcd_handler ")


_SHOW_SHARED_STORE_ENV = (
    "import os\n"
    "import torch.distributed.elastic.rendezvous.registry\n"
    f"print(os.environ.get({plugin.DISABLE_SHARED_STORE_ENV!r}, 'unset'))\n"
)


@pytest.mark.parametrize("torch_etcd", ["0", "1"])
def test_loading_torchs_registry_gives_each_round_its_own_worker_store(torch_etcd, monkeypatch):
    # torchrun imports the registry whatever --rdzv-backend names (--standalone and c10d too).
    monkeypatch.delenv(plugin.DISABLE_SHARED_STORE_ENV, raising=False)
    assert _python(_SHOW_SHARED_STORE_ENV, **{plugin.TORCH_ETCD_ENV: torch_etcd}) == "1"


def test_a_users_shared_store_setting_wins_over_the_plugins():
    assert _python(_SHOW_SHARED_STORE_ENV, **{plugin.DISABLE_SHARED_STORE_ENV: "0"}) == "0"


def test_the_handlers_workers_use_their_rounds_agent_store(etcd_endpoint, monkeypatch):
    monkeypatch.setenv(plugin.DISABLE_SHARED_STORE_ENV, "1")
    handler = plugin.create_rdzv_handler(params(etcd_endpoint))
    try:
        assert handler.use_agent_store is True  # what torch's agent tells the workers
    finally:
        handler.leave()


def test_asking_the_handler_for_torchs_shared_store_is_refused_naming_the_variable(etcd_endpoint, monkeypatch):
    monkeypatch.setenv(plugin.DISABLE_SHARED_STORE_ENV, "0")
    with pytest.raises(ValueError, match=f"{plugin.DISABLE_SHARED_STORE_ENV}=0 .* fresh store on its rank-0 agent"):
        plugin.create_rdzv_handler(params(etcd_endpoint))


_C10D_USE_AGENT_STORE = (
    "import sys\n"
    "from torch.distributed.elastic.rendezvous import RendezvousParameters\n"
    "from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler\n"
    "handler = get_rendezvous_handler(RendezvousParameters(backend='c10d', endpoint=sys.argv[1], run_id='r',\n"
    "                                                      min_nodes=1, max_nodes=1, is_host=True))\n"
    "print(handler.use_agent_store)\n"
)


def test_a_c10d_agent_where_this_package_is_installed_hosts_a_worker_store_per_round_too(monkeypatch):
    # Deliberately global (see plugin._per_round_worker_store): torch's shared store breaks the
    # restart of a killed worker under --standalone / c10d.
    monkeypatch.delenv(plugin.DISABLE_SHARED_STORE_ENV, raising=False)
    result = subprocess.run(
        [sys.executable, "-c", _C10D_USE_AGENT_STORE, f"127.0.0.1:{free_port()}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_importing_the_package_and_plugin_does_not_import_grpc_or_etcd3():
    out = _python(
        "import sys, elastic_ddp.rendezvous, elastic_ddp.rendezvous.plugin\n"
        "import torch.distributed.elastic.rendezvous\n"
        "print(sorted(m for m in ('grpc', 'etcd3') if m in sys.modules))\n"
    )
    assert out == "[]"


# -- end to end with torchrun ----------------------------------------------------------------------


def _torchrun(backend: str, endpoint: str, run_id: str, nnodes: str = "2") -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={nnodes}", "--nproc-per-node=1",
        f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
        "--monitor-interval=0.1", str(WORKER),
    ]  # fmt: skip


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop(plugin.TORCH_ETCD_ENV, None)
    return env


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["etcd", "etcd-v3"])
def test_two_torchrun_agents_rendezvous_and_all_reduce(backend, etcd_endpoint, etcd_client, tmp_path):
    run_id = f"e2e-{uuid.uuid4().hex[:8]}"
    nodes = [start_node(_torchrun(backend, etcd_endpoint, run_id), _env(), tmp_path / f"node{i}.log") for i in range(2)]
    try:
        codes = [node.wait(timeout=180) for node in nodes]
        outputs = [node.output() for node in nodes]
        assert codes == [0, 0], "\n\n".join(outputs)
        lines = sorted(l for out in outputs for l in out.splitlines() if "RDZV_WORKER" in l)
        assert len(lines) == 2, "\n\n".join(outputs)
        assert all("world_size=2 sum=2" in l for l in lines)
        assert {"rank=0", "rank=1"} == {l.split()[1] for l in lines}
        # The rendezvous went through the v3 API (the server has v2 off, so torch's v2 code could
        # not have run), and the job closed it when it finished.
        record = etcd_client.get(f"{plugin.DEFAULT_KEY_PREFIX}/{run_id}/round")
        assert record is not None and b'"closed":true' in record.value
    finally:
        for node in nodes:
            node.cleanup()


@pytest.mark.slow
def test_agents_started_seconds_apart_form_one_round(etcd_endpoint, etcd_client, tmp_path):
    # torch's test_launch_elastic_multiple_agents: the second agent starts ~3 s after the first.
    # The first round's last call (first_round_timeout, 30 s) waits for it; a 2 s last call would
    # have started the first alone, and admitting the second would cost a restart.
    run_id = f"skew-{uuid.uuid4().hex[:8]}"
    cmd = _torchrun("etcd", etcd_endpoint, run_id, nnodes="1:2")
    first = start_node(cmd, _env(), tmp_path / "node0.log")
    nodes = [first]
    try:
        wait_for(lambda: "has its minimum of 1 node(s)" in first.output(), 60, what="the first round's last call")
        time.sleep(3)
        nodes.append(start_node(cmd, _env(), tmp_path / "node1.log"))
        codes = [node.wait(timeout=180) for node in nodes]
        outputs = [node.output() for node in nodes]
        assert codes == [0, 0], "\n\n".join(outputs)
        lines = [l for out in outputs for l in out.splitlines() if "RDZV_WORKER" in l]
        assert len(lines) == 2 and all("world_size=2 sum=2" in l for l in lines), "\n\n".join(outputs)
    finally:
        for node in nodes:
            node.cleanup()


@pytest.mark.slow
def test_the_directory_of_a_killed_agent_is_removed_when_the_next_agent_starts(etcd_endpoint, tmp_path):
    # An agent killed outright cannot remove its directory; on a host that outlives it, the next
    # agent's start does. (A temp directory of the test's own with a short path: under a long one the
    # agent's directory goes in /tmp, see elastic_ddp/rendezvous/agent_dir.py.)
    temp = Path(tempfile.mkdtemp(prefix="edp-", dir="/tmp"))
    env = {**_env(), "TMPDIR": str(temp)}
    try:
        waiting = start_node(_torchrun("etcd", etcd_endpoint, f"killed-{uuid.uuid4().hex[:8]}"), env,
                             tmp_path / "killed.log")  # fmt: skip
        try:
            left = wait_for(lambda: [p for p in temp.glob("elastic_ddp-agent-*") if (p / "owner").exists()], 60,
                            what="the agent's directory")  # fmt: skip
            waiting.kill()
        finally:
            waiting.cleanup()
        assert all(path.exists() for path in left), "the killed agent removed its directory"
        with start_node(_torchrun("etcd", etcd_endpoint, f"next-{uuid.uuid4().hex[:8]}", nnodes="1"), env,
                        tmp_path / "next.log") as following:  # fmt: skip
            assert following.wait(timeout=120) == 0, following.output()
        assert not any(path.exists() for path in left), following.output()
        assert list(temp.glob("elastic_ddp-agent-*")) == [], "the agent that ended left its directory"
    finally:
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_torchrun_exits_nonzero_naming_the_endpoint_when_etcd_is_unreachable(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    cmd = _torchrun("etcd", endpoint, "unreachable", nnodes="1")
    cmd.insert(3, "--rdzv-conf=read_timeout=2,join_timeout=30")
    start = time.monotonic()
    with start_node(cmd, _env(), tmp_path / "node.log") as node:
        code = node.wait(timeout=120)
        elapsed = time.monotonic() - start
        assert code != 0
        assert elapsed < 30 + 10  # within the join timeout (plus interpreter start-up)
        assert endpoint in node.output(), node.output()


def test_a_waiting_node_wakes_when_the_last_one_joins_not_at_its_next_poll(etcd_endpoint, monkeypatch):
    import threading

    from elastic_ddp.rendezvous import join as join_module

    # Were the waiting node polling, it would now look again only after two minutes.
    monkeypatch.setattr(join_module, "_MAX_WAIT_S", 120.0)
    monkeypatch.setenv(plugin.DISABLE_SHARED_STORE_ENV, "1")
    run_id = f"watch-{uuid.uuid4().hex[:8]}"

    def make():
        return plugin.create_rdzv_handler(
            RendezvousParameters(backend="etcd-v3", endpoint=etcd_endpoint, run_id=run_id, min_nodes=2, max_nodes=2)
        )

    first, second = make(), make()
    results: dict[str, object] = {}
    waiting = threading.Thread(target=lambda: results.setdefault("first", first.next_rendezvous()), daemon=True)
    try:
        waiting.start()
        wait_for(lambda: first._joiner._registered is not None, 30, what="the first node to register and wait")
        info = second.next_rendezvous()
        waiting.join(timeout=30)
        assert not waiting.is_alive(), "the waiting node did not notice the round completing"
        assert info.world_size == results["first"].world_size == 2
        assert {info.rank, results["first"].rank} == {0, 1}
    finally:
        for each in (first, second):
            each.shutdown()
