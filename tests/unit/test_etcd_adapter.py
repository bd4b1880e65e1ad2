"""The installed python-etcd3 still has every private name elastic_ddp/etcd/_etcd3.py relies on.

No server is needed: the client is built on an endpoint nobody dials (gRPC connects lazily), and
each adapter function is run on it. A failure names the missing attribute, so an etcd3 upgrade
that renames one fails here instead of in a failover at run time.
"""

from __future__ import annotations

import etcd3
import pytest

from elastic_ddp.etcd import _etcd3


@pytest.fixture
def raw():
    endpoints = [etcd3.Endpoint("127.0.0.1", port, secure=False, time_retry=1.0) for port in (1, 2)]
    client = etcd3.MultiEndpointEtcd3Client(endpoints=endpoints, timeout=1.0, failover=True)
    try:
        yield client
    finally:
        client.close()


def _instance(cls: type, raw):
    return raw if cls is etcd3.MultiEndpointEtcd3Client else next(iter(raw.endpoints.values()))


@pytest.mark.parametrize(
    ("cls", "name"),
    [(cls, name) for cls, names in _etcd3.PRIVATE_NAMES.items() for name in names],
    ids=lambda value: value if isinstance(value, str) else value.__name__,
)
def test_the_installed_etcd3_has_each_name_the_adapter_uses(cls, name, raw):
    obj = _instance(cls, raw)
    assert hasattr(obj, name), (
        f"The installed etcd3 {getattr(etcd3, '__version__', '(version unknown)')} has no "
        f"{cls.__module__}.{cls.__name__}.{name}, which elastic_ddp/etcd/_etcd3.py uses: adapt that module."
    )


def test_the_endpoint_label_can_be_set():
    prop = getattr(etcd3.MultiEndpointEtcd3Client, "_current_endpoint_label", None)
    assert isinstance(prop, property) and prop.fset is not None, (
        "etcd3.MultiEndpointEtcd3Client._current_endpoint_label is no longer a settable property: "
        "elastic_ddp/etcd/_etcd3.start_at needs another way to pick the first endpoint."
    )


def test_start_at_makes_the_named_endpoint_the_one_in_use(raw):
    second = list(raw.endpoints.values())[1]
    _etcd3.start_at(raw, second)
    assert raw.endpoint_in_use is second


def test_install_token_puts_the_token_on_every_call(raw):
    _etcd3.install_token(raw, "t0ken")
    assert _etcd3.call_options(raw) == {"credentials": None, "metadata": (("token", "t0ken"),)}


def test_failing_the_endpoint_in_use_and_forgetting_failures(raw):
    first = raw.endpoint_in_use
    _etcd3.fail_endpoint_in_use(raw)
    assert first.is_failed()
    _etcd3.forget_failures(raw)
    assert not any(endpoint.is_failed() for endpoint in raw.endpoints.values())
