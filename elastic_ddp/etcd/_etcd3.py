"""The one place touching python-etcd3's private or undocumented names.

:class:`~elastic_ddp.etcd.client.EtcdClient` drives ``etcd3.MultiEndpointEtcd3Client`` further
than its documented API allows: it picks the first endpoint, installs an authentication token
itself (so that a token can be renewed after a failover), reuses the client's per-call
credentials on its own stubs, and marks members failed or healthy. Each of those is one function
here, named for what it does; :data:`PRIVATE_NAMES` lists every attribute they rely on, and
``tests/unit/test_etcd_adapter.py`` fails naming the attribute when an installed etcd3 lacks one.
"""

from __future__ import annotations

import etcd3

__all__ = ["PRIVATE_NAMES", "call_options", "fail_endpoint_in_use", "forget_failures", "install_token", "start_at"]

PRIVATE_NAMES: dict[type, tuple[str, ...]] = {
    etcd3.MultiEndpointEtcd3Client: (
        "_current_endpoint_label",  # the label of the endpoint in use (a property with a setter)
        "_clear_old_stubs",  # drops the stubs (and watcher) bound to the old channel or metadata
        "metadata",  # gRPC metadata sent with every call: the auth token
        "call_credentials",  # per-call credentials; None when the metadata carries the token
        "endpoints",  # netloc -> Endpoint
        "endpoint_in_use",
    ),
    etcd3.Endpoint: (
        "last_failed",  # time.time() of the endpoint's last failure; 0: healthy
        "netloc",
    ),
}


def start_at(raw: etcd3.MultiEndpointEtcd3Client, endpoint: etcd3.Endpoint) -> None:
    """Make ``endpoint`` the one the next request goes to (etcd3 picks one at random)."""
    raw._current_endpoint_label = endpoint.netloc


def install_token(raw: etcd3.MultiEndpointEtcd3Client, token: str) -> None:
    """Send ``token`` with every later request, on etcd3's own methods and on our stubs alike."""
    raw.metadata = (("token", token),)
    raw.call_credentials = None  # the metadata alone carries the token
    raw._clear_old_stubs()  # the cached watcher holds the old metadata


def call_options(raw: etcd3.MultiEndpointEtcd3Client) -> dict:
    """The keyword arguments that make a call on a stub of ``raw.channel`` carry the auth token."""
    return {"credentials": raw.call_credentials, "metadata": raw.metadata}


def fail_endpoint_in_use(raw: etcd3.MultiEndpointEtcd3Client) -> None:
    """Mark the member in use as failed, so the next request (or stream) goes to another."""
    raw.endpoint_in_use.fail()
    raw._clear_old_stubs()


def forget_failures(raw: etcd3.MultiEndpointEtcd3Client) -> None:
    """Mark every member healthy again, so the next requests dial them all."""
    for endpoint in raw.endpoints.values():
        endpoint.last_failed = 0
