"""torchrun plugin: ``--rdzv-backend=etcd-v3`` and ``--rdzv-backend=etcd`` on etcd's v3 API.

Both names are entry points of group ``torchrun.handlers`` (see pyproject.toml). torch registers
its own legacy v2 ``etcd`` handler before loading entry points and refuses a second creator for a
name, so :func:`etcd_handler` first removes torch's entry (:func:`_torch_handler_registry` is the
one place touching torch's private registry dict). ``ELASTIC_DDP_TORCH_ETCD=1`` keeps torch's own.

This module imports neither grpc nor etcd3; the etcd client (elastic_ddp.etcd) is imported when a
handler is created.

Recovery defaults -- what bounds "SIGKILL of one node -> survivors train again" (measured with
``benchmarks/bench_recovery.py`` and the chaos suite):

1. The survivors' workers fail at once (gloo sees the peer's sockets close); each agent notices
   within its monitor interval (0.1 s) and asks for a new round. Death of the lost node does not
   have to be detected first: it simply never registers for the new round.
2. The round completes as soon as every node of the previous round is back, except those whose
   agent refuses a liveness probe (the handler's point 6): no fixed wait when the lost node's host
   still runs. A node that cannot be probed (its host is down) is waited for ``last_call_timeout``
   (torch: 30 s; 2 s here: nodes already restarting together re-register within ~0.5 s of each
   other). A run's first round waits ``first_round_timeout`` (torch's 30 s) for nodes started
   seconds apart, unless ``max_nodes`` registered.
3. The workers restart (interpreter + torch import + process group init: ~2 s here).

The phases of a recovery are measured by ``benchmarks/bench_recovery.py``.

A node that dies while its group does not notice (no collective running, or an NCCL hang) is
seen through its lease: it ends ``keep_alive_interval * keep_alive_max_attempt`` = 1 s * 5 = 5 s
after the node's last renewal, and every member of its round is told by a watch. 5 s, not less:
a healthy node must survive an etcd leader election, during which no renewal is answered
(measured on 3 local members: renewals resume ~1-1.5 s after the leader is killed, and the new
leader gives every lease its full TTL again). ``heartbeat_timeout`` bounds one renewal (at most
half the TTL, so a renewal stuck on a silent member leaves time to try another).

``join_timeout`` stays torch's 600 s: it bounds waiting for ``min_nodes`` to appear at all, not
recovery. The user's rdzv_conf values always win over these defaults.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousHandler, RendezvousParameters

from elastic_ddp.contract import ENV_ETCD_PASSWORD as PASSWORD_ENV
from elastic_ddp.contract import ENV_TORCH_ETCD as TORCH_ETCD_ENV

if TYPE_CHECKING:  # pragma: no cover
    from elastic_ddp.rendezvous.backend import EtcdV3RendezvousBackend
    from elastic_ddp.etcd import EtcdClient
    from elastic_ddp.rendezvous.handler import EtcdRendezvousHandler
    from elastic_ddp.rendezvous.settings import HandlerSettings
    from elastic_ddp.rendezvous.store import EtcdV3Store

__all__ = [
    "DEFAULT_CLOSE_TIMEOUT",
    "DEFAULT_RUN_TTL",
    "DEFAULT_HEARTBEAT_TIMEOUT",
    "DEFAULT_KEEP_ALIVE_INTERVAL",
    "DEFAULT_KEEP_ALIVE_MAX_ATTEMPT",
    "DEFAULT_FIRST_ROUND_TIMEOUT",
    "DEFAULT_LAST_CALL_TIMEOUT",
    "DEFAULT_READ_TIMEOUT",
    "PASSWORD_ENV",
    "TORCH_ETCD_ENV",
    "create_backend",
    "create_rdzv_handler",
    "etcd_handler",
    "etcd_v3_handler",
]

DISABLE_SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""torch's switch for its own handlers: ``1`` makes each rendezvous round host a new store on its
rank-0 worker instead of one TCPStore on the first round's rank-0 agent (see
:func:`_per_round_worker_store`)."""

DEFAULT_ENDPOINT_PORT = 2379
DEFAULT_READ_TIMEOUT = 10  # seconds per etcd request; torch's etcd-v2 uses 60
DEFAULT_KEY_PREFIX = "/elastic_ddp/rendezvous"

# Recovery defaults (see the module docstring for the reasoning).
DEFAULT_KEEP_ALIVE_INTERVAL = 1  # torch: 5 s; seconds between lease renewals
DEFAULT_KEEP_ALIVE_MAX_ATTEMPT = 5  # torch: 3; lease TTL = 1 s * 5: a silent node is gone after 5 s
DEFAULT_LAST_CALL_TIMEOUT = 2  # torch: 30 s
DEFAULT_FIRST_ROUND_TIMEOUT = 30  # torch's last call, which it uses for every round
DEFAULT_HEARTBEAT_TIMEOUT = 5  # torch: 5 s; the longest one renewal may take (capped at TTL / 2)
DEFAULT_CLOSE_TIMEOUT = 10  # torch: 30 s; time to mark the rendezvous closed at shutdown
DEFAULT_JOIN_TIMEOUT = 600  # torch's
DEFAULT_RUN_TTL = 7200  # the round record outlives the run's last node by 2 h (torch's etcd-v2: 2 h)

_HANDLER_DEFAULTS: dict[str, int] = {
    "keep_alive_interval": DEFAULT_KEEP_ALIVE_INTERVAL,
    "keep_alive_max_attempt": DEFAULT_KEEP_ALIVE_MAX_ATTEMPT,
    "last_call_timeout": DEFAULT_LAST_CALL_TIMEOUT,
    "heartbeat_timeout": DEFAULT_HEARTBEAT_TIMEOUT,
    "close_timeout": DEFAULT_CLOSE_TIMEOUT,
}

# rdzv_conf keys read by this module; first spelling is ours, the others torch's etcd / etcd-v2.
_ALIASES: dict[str, tuple[str, ...]] = {
    "protocol": ("protocol",),
    "ca_cert": ("ca_cert", "cacert"),
    "ssl_cert": ("ssl_cert", "cert"),
    "ssl_cert_key": ("ssl_cert_key", "key"),
    "key_prefix": ("key_prefix", "etcd_prefix"),
    "read_timeout": ("read_timeout",),
    "user": ("user",),
}
# Keys torch's handler reads, or torchrun itself adds ("timeout": its legacy join timeout, always
# set; "rank": --node-rank), accepted and passed through; and this handler's own timing keys.
_TORCH_KEYS = frozenset(
    {"join_timeout", "timeout", "rank", "is_host", "local_addr", "heartbeat", "first_round_timeout",
     *_HANDLER_DEFAULTS}
)


def _conf(params: RendezvousParameters, name: str) -> tuple[str, Any] | None:
    """(spelling used, value) of an option given under any of its spellings; None if absent."""
    given = [(alias, params.config[alias]) for alias in _ALIASES[name] if params.config.get(alias) is not None]
    if len(given) > 1 and len({str(v) for _, v in given}) > 1:
        spellings = " and ".join(f"'{a}' ({v!r})" for a, v in given)
        raise ValueError(f"The rendezvous options {spellings} are the same setting with different values.")
    return given[0] if given else None


def _check_keys(params: RendezvousParameters) -> None:
    if "password" in params.config:
        raise ValueError(
            "The rendezvous option 'password' is not accepted: rdzv_conf is visible to every user "
            f"in the process list and in logs. Set the environment variable {PASSWORD_ENV} instead."
        )
    known = {alias for aliases in _ALIASES.values() for alias in aliases} | _TORCH_KEYS
    unknown = sorted(set(params.config) - known)
    if unknown:
        raise ValueError(
            f"The rendezvous option(s) {', '.join(repr(k) for k in unknown)} are not known to the etcd-v3 "
            f"backend. Known options: {', '.join(sorted(known))}."
        )


def _read_timeout(params: RendezvousParameters) -> float:
    given = _conf(params, "read_timeout")
    if given is None:
        return float(DEFAULT_READ_TIMEOUT)
    key, raw = given
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = float("nan")
    if not value > 0:
        raise ValueError(
            f"The rendezvous option '{key}' ({raw!r}) must be a positive number of seconds."
        )
    return value


def _tls(params: RendezvousParameters) -> tuple[bool, str | None, str | None, str | None]:
    protocol = _conf(params, "protocol")
    scheme = "http" if protocol is None else str(protocol[1]).strip().lower()
    if scheme not in ("http", "https"):
        raise ValueError(f"The rendezvous option 'protocol' ({protocol[1]!r}) must be 'http' or 'https'.")
    files = {}
    for name in ("ca_cert", "ssl_cert", "ssl_cert_key"):
        given = _conf(params, name)
        if given is None:
            files[name] = None
            continue
        key, path = given
        if scheme != "https":
            raise ValueError(f"The rendezvous option '{key}' ({path!r}) needs protocol=https.")
        if not os.path.isfile(str(path)):
            raise ValueError(f"The rendezvous option '{key}' ({path!r}) is not a readable file.")
        files[name] = str(path)
    if (files["ssl_cert"] is None) != (files["ssl_cert_key"] is None):
        raise ValueError(
            "The rendezvous options 'ssl_cert' ('cert') and 'ssl_cert_key' ('key') must be given together."
        )
    return scheme == "https", files["ca_cert"], files["ssl_cert"], files["ssl_cert_key"]


def _key_prefix(params: RendezvousParameters) -> str:
    given = _conf(params, "key_prefix")
    if given is None:
        return DEFAULT_KEY_PREFIX
    key, raw = given
    prefix = str(raw).rstrip("/")
    if not prefix.startswith("/"):
        raise ValueError(f"The rendezvous option '{key}' ({raw!r}) must be an absolute etcd key path such as '/my/prefix'.")
    return prefix


def create_client(params: RendezvousParameters) -> EtcdClient:
    """The etcd client described by ``params`` (see :func:`create_backend` for the options)."""
    from elastic_ddp.etcd import EtcdClient, EtcdError, parse_endpoints

    _check_keys(params)
    _key_prefix(params)  # validate every option before any connection is made
    endpoint = params.endpoint.strip() or f"localhost:{DEFAULT_ENDPOINT_PORT}"
    try:
        parse_endpoints(endpoint, DEFAULT_ENDPOINT_PORT)
    except ValueError as exc:
        raise ValueError(f"The rendezvous endpoint ({params.endpoint!r}) is invalid: {exc}") from None
    tls, ca_cert, cert, key = _tls(params)
    user_given = _conf(params, "user")
    user = None if user_given is None else str(user_given[1])
    password = os.environ.get(PASSWORD_ENV)
    if user is not None and not password:
        raise ValueError(f"The rendezvous option 'user' ({user!r}) needs the password in the environment variable {PASSWORD_ENV}.")
    if user is None and password:
        raise ValueError(f"{PASSWORD_ENV} is set but the rendezvous option 'user' is not; set both or neither.")
    try:
        return EtcdClient(
            endpoint,
            timeout=_read_timeout(params),
            tls=tls,
            ca_cert=ca_cert,
            cert=cert,
            key=key,
            user=user,
            password=password,
        )
    except EtcdError as exc:  # only authentication contacts etcd here
        raise _first_request_failed(params, exc) from exc


def _first_request_failed(params: RendezvousParameters, exc: Exception) -> RendezvousConnectionError:
    """The error for an etcd that did not answer (or refused) the first request of a backend or
    handler; ``exc`` (the client's error) names the endpoints tried and the cause."""
    return RendezvousConnectionError(
        f"The etcd-v3 rendezvous expected an etcd v3 server accepting its requests at --rdzv-endpoint "
        f"{params.endpoint!r}, but the first request failed (read_timeout {_read_timeout(params):g} s): {exc}"
    )


def _connected_client(params: RendezvousParameters) -> EtcdClient:
    """:func:`create_client`, checked to reach etcd, as torch's own etcd backends do when created.

    A wrong ``--rdzv-endpoint`` or an etcd that is down then fails torchrun at start-up with one
    error naming the endpoints, not later at the first rendezvous step. With a ``user`` the
    authentication in :func:`create_client` is that check; without, one point read of the run's
    prefix (the key need not exist). It takes at most ``read_timeout`` (default 10 s); a refused
    connection fails in about 1.5 s, once every endpoint was tried.

    Raises:
        RendezvousConnectionError: etcd did not answer or refused the request.
    """
    from elastic_ddp.etcd import EtcdError

    client = create_client(params)
    if _conf(params, "user") is None:
        try:
            client.get(f"{_key_prefix(params)}/{params.run_id}/")
        except EtcdError as exc:
            client.close()  # else gRPC keeps redialling the endpoints in the background
            raise _first_request_failed(params, exc) from exc
    return client


def create_backend(params: RendezvousParameters) -> tuple[EtcdV3RendezvousBackend, EtcdV3Store]:
    """torch's ``RendezvousBackend`` on etcd v3 and the c10d store, for users who build torch's own
    ``DynamicRendezvousHandler`` (``torchrun --rdzv-backend=etcd`` uses :func:`create_rdzv_handler`).

    The backend keeps the whole rendezvous in one key that every node rewrites at each heartbeat;
    it serves tens of nodes, not hundreds (see docs/rendezvous.md).

    ``params.endpoint`` is a comma-separated list of ``host[:port]`` (port 2379 by default,
    ``localhost:2379`` if empty); requests fail over between them. Both this and
    :func:`create_rdzv_handler` make one request to etcd before returning and raise
    ``RendezvousConnectionError`` naming the endpoints when it fails (at most ``read_timeout``).
    Connection options, shared with :func:`create_rdzv_handler`:

    +---------------------------+--------------------------------------------------------------+
    | rdzv_conf key (aliases)   | Meaning and default                                          |
    +===========================+==============================================================+
    | protocol                  | ``http`` or ``https``. Default ``http``.                     |
    | ca_cert (cacert)          | CA bundle verifying the server (https). Default: system CAs. |
    | ssl_cert (cert)           | Client certificate for mutual TLS (https). Default none.     |
    | ssl_cert_key (key)        | Private key of ``ssl_cert``. Default none.                   |
    | key_prefix (etcd_prefix)  | etcd key prefix. Default ``/elastic_ddp/rendezvous``.        |
    | read_timeout              | Seconds per etcd request. Default 10.                        |
    | user                      | etcd user; the password comes only from the environment     |
    |                           | variable ``ELASTIC_DDP_ETCD_PASSWORD``. Default none.       |
    | password                  | Refused (rdzv_conf is visible in ``ps`` and logs).          |
    +---------------------------+--------------------------------------------------------------+

    Any key that is neither these nor a handler key (:func:`create_rdzv_handler`) raises
    ``ValueError``. Layout: the state is ``<key_prefix>/<run_id>/state``; the store's keys are
    under ``<key_prefix>/<run_id>/store/``.
    """
    from elastic_ddp.rendezvous.backend import EtcdV3RendezvousBackend
    from elastic_ddp.rendezvous.store import EtcdV3Store

    client = _connected_client(params)
    prefix = _key_prefix(params)
    # torch checks that the handler's backend name equals the requested --rdzv-backend.
    name = params.backend if params.backend in ("etcd", "etcd-v3") else "etcd-v3"
    backend = EtcdV3RendezvousBackend(client, params.run_id, key_prefix=prefix, name=name)
    store = EtcdV3Store(client, f"{prefix}/{params.run_id}/store/")
    return backend, store


def _with_recovery_defaults(params: RendezvousParameters) -> RendezvousParameters:
    """A copy of ``params`` with this project's handler defaults for keys the user did not set."""
    config = {**_HANDLER_DEFAULTS, **{k: v for k, v in params.config.items() if v is not None}}
    return RendezvousParameters(
        backend=params.backend,
        endpoint=params.endpoint,
        run_id=params.run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        local_addr=params.local_addr,
        **config,
    )


def _seconds(params: RendezvousParameters, *keys: str) -> int | None:
    for key in keys:
        value = params.get(key)
        if value is None:
            continue
        try:
            seconds = int(value)
        except (TypeError, ValueError):
            seconds = -1
        if seconds <= 0:
            raise ValueError(f"The rendezvous option '{key}' ({value!r}) must be a positive whole number of seconds.")
        return seconds
    return None


def handler_settings(params: RendezvousParameters) -> HandlerSettings:
    """The handler's settings from ``params`` (with this project's defaults already merged in)."""
    from elastic_ddp.rendezvous.settings import HandlerSettings

    interval = _seconds(params, "keep_alive_interval") or DEFAULT_KEEP_ALIVE_INTERVAL
    attempts = _seconds(params, "keep_alive_max_attempt") or DEFAULT_KEEP_ALIVE_MAX_ATTEMPT
    ttl = interval * attempts
    heartbeat = _seconds(params, "heartbeat", "heartbeat_timeout") or DEFAULT_HEARTBEAT_TIMEOUT
    return HandlerSettings(
        run_id=params.run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        key_prefix=_key_prefix(params),
        join_timeout=_seconds(params, "join_timeout") or DEFAULT_JOIN_TIMEOUT,
        last_call_timeout=_seconds(params, "last_call_timeout") or DEFAULT_LAST_CALL_TIMEOUT,
        first_round_timeout=_seconds(params, "first_round_timeout") or DEFAULT_FIRST_ROUND_TIMEOUT,
        close_timeout=_seconds(params, "close_timeout") or DEFAULT_CLOSE_TIMEOUT,
        keep_alive_interval=interval,
        lease_ttl=ttl,
        keep_alive_deadline=min(float(heartbeat), ttl / 2),
        run_ttl=DEFAULT_RUN_TTL,
    )


def create_rdzv_handler(params: RendezvousParameters) -> EtcdRendezvousHandler:
    """torchrun's handler creator: an :class:`~elastic_ddp.rendezvous.handler.EtcdRendezvousHandler`
    (per-node state in etcd, leases for liveness; see that module).

    Connection options as for :func:`create_backend`. Handler options (torch's names), with this
    project's defaults when not given:

    +------------------------------+-----------------------------------------------------------+
    | rdzv_conf key                | Meaning and default                                       |
    +==============================+===========================================================+
    | join_timeout                 | Seconds to wait for a round with this node. 600.          |
    | last_call_timeout            | Seconds a round after the first waits, once ``min_nodes`` |
    |                              | registered, for nodes it cannot account for (none once    |
    |                              | ``max_nodes`` did, or every live node is back). 2.        |
    | first_round_timeout          | The same for a run's first round: the start-up skew of    |
    |                              | the nodes of a cluster. 30 (torch's last call).           |
    | close_timeout                | Seconds to mark the rendezvous closed at shutdown. 10.    |
    | keep_alive_interval          | Seconds between lease renewals. 1 (torch: 5).             |
    | keep_alive_max_attempt       | Renewals a node may miss: its lease TTL is                |
    |                              | ``keep_alive_interval * keep_alive_max_attempt``. 5.      |
    | heartbeat_timeout (heartbeat)| Longest one renewal may take (at most TTL / 2). 5.        |
    +------------------------------+-----------------------------------------------------------+

    torchrun's own ``timeout``, ``rank``, ``is_host`` and ``local_addr`` are accepted and ignored.
    """
    from elastic_ddp.logs import configure_logging
    from elastic_ddp.rendezvous.handler import EtcdRendezvousHandler
    from elastic_ddp.rendezvous.store import EtcdV3Store

    configure_logging("agent")
    params = _with_recovery_defaults(params)
    settings = handler_settings(params)  # every option is checked before a connection is made
    _refuse_shared_store()
    client = _connected_client(params)
    store = EtcdV3Store(client, f"{settings.key_prefix}/{params.run_id}/store/")
    name = params.backend if params.backend in ("etcd", "etcd-v3") else "etcd-v3"
    return EtcdRendezvousHandler(client, store, settings, backend_name=name, local_addr=params.local_addr)


def _refuse_shared_store() -> None:
    """This handler gives every round a fresh worker store on its rank-0 agent, whatever
    :data:`DISABLE_SHARED_STORE_ENV` says: a user's ``0`` (torch's one store shared across rounds)
    cannot take effect, so it is refused by name instead of ignored."""
    if os.environ.get(DISABLE_SHARED_STORE_ENV, "").strip() == "0":
        raise ValueError(
            f"{DISABLE_SHARED_STORE_ENV}=0 asks for torch's one worker store shared across rendezvous rounds, "
            "which this handler does not use: every round gets a fresh store on its rank-0 agent (a shared "
            "one keeps a dead group's keys). Unset the variable for jobs on this handler."
        )


def _per_round_worker_store() -> None:
    """Make torch's own handlers (``c10d``, ``--standalone``, torch's ``etcd``) in this process give
    every rendezvous round a fresh worker store, unless the user chose otherwise by setting
    :data:`DISABLE_SHARED_STORE_ENV` themselves (``0`` keeps torch's shared store). This package's
    handler needs no variable: each of its rounds' rank-0 agent hosts a new store
    (:meth:`elastic_ddp.rendezvous.node.NodeServices.bootstrap`), and it refuses a ``0``
    (:func:`_refuse_shared_store`).

    Deliberately process-wide. torch's shared worker TCPStore lives in the agent that was rank 0 of
    the first round and keeps its keys across restarts: a restarted group's gloo reads the dead
    workers' addresses and fails (``Gloo connectFullMesh failed ... Connection refused``) until
    every restart is spent -- the recipes' ``torchrun --standalone`` could not recover a killed
    worker (torch 2.13) -- and across nodes a membership change can leave a round with an address
    no one serves. Without sharing, each round's rank-0 worker hosts a fresh store, so no node stays
    a single point of failure.

    torch reads the variable only through its handler: ``use_agent_store`` whenever the agent starts
    workers (exported to them as ``TORCHELASTIC_USE_AGENT_STORE``) and ``next_rendezvous`` at every
    round. In a ``c10d`` agent no code of this package runs but the entry-point loaders (torch loads
    every ``torchrun.handlers`` entry point when its handler registry is imported, whatever
    ``--rdzv-backend`` names), so they call this: every torchrun agent in an environment with this
    package installed -- like any process importing torch's rendezvous package -- runs without the
    shared store, and its workers inherit the setting.
    """
    os.environ.setdefault(DISABLE_SHARED_STORE_ENV, "1")


def etcd_v3_handler() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """Entry point ``etcd-v3``: returns the handler creator (and sets up per-round worker stores,
    see :func:`_per_round_worker_store`)."""
    _per_round_worker_store()
    return create_rdzv_handler


def _torch_handler_registry() -> dict[str, Callable[[RendezvousParameters], RendezvousHandler]]:
    """torch's registry dict (private: ``RendezvousHandlerRegistry._registry``); the only access.

    Raises:
        RuntimeError: torch changed the registry's shape; this plugin then needs updating.
    """
    from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry

    registry = getattr(rendezvous_handler_registry, "_registry", None)
    if not isinstance(registry, dict):
        raise RuntimeError(
            "torch's rendezvous handler registry no longer has a '_registry' dict "
            f"(found {type(registry).__name__}); elastic_ddp cannot replace torch's 'etcd' handler. "
            f"Use --rdzv-backend=etcd-v3, or set {TORCH_ETCD_ENV}=1 to keep torch's."
        )
    return registry


def etcd_handler() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """Entry point ``etcd``: replaces torch's legacy v2 handler unless ``ELASTIC_DDP_TORCH_ETCD=1``.

    torch registers each entry point's creator under its name and refuses a different creator for
    a taken name. With the env var set this returns torch's own creator, so registering it again
    is a no-op; otherwise torch's entry is removed first. Either way this sets up per-round
    worker stores (:func:`_per_round_worker_store`).
    """
    _per_round_worker_store()
    registry = _torch_handler_registry()
    if os.environ.get(TORCH_ETCD_ENV, "").strip() == "1":
        torch_creator = registry.get("etcd")
        if torch_creator is None or torch_creator is create_rdzv_handler:
            # torch registers its defaults before loading entry points, so this means torch
            # changed that order; say so instead of silently serving the v3 handler.
            raise RuntimeError(
                f"{TORCH_ETCD_ENV}=1 asks for torch's own 'etcd' handler, but torch has not registered one."
            )
        return torch_creator
    if registry.get("etcd") is not create_rdzv_handler:
        registry.pop("etcd", None)
    return create_rdzv_handler
