"""The exceptions of :mod:`elastic_ddp.etcd` and the one place mapping gRPC and etcd3 errors to them.

Everything above this package sees only :class:`EtcdError` and its subclasses: neither ``grpc``
nor ``etcd3`` types cross the package boundary. Errors are told apart by their gRPC status code;
a message is read only where etcd reports different conditions under one code (each such place
names the etcd errors involved, from etcd's ``api/v3rpc/rpctypes/error.go``).
"""

from __future__ import annotations

import enum

import etcd3.exceptions
import grpc

__all__ = [
    "EtcdAuthError",
    "EtcdCompactedError",
    "EtcdConnectionError",
    "EtcdError",
    "EtcdLeaseExistsError",
    "EtcdLeaseNotFoundError",
    "Fault",
    "classify",
    "connection_error",
    "describe",
    "to_etcd_error",
]


class EtcdError(Exception):
    """Base class of every error raised by :class:`~elastic_ddp.etcd.client.EtcdClient`."""


class EtcdConnectionError(EtcdError):
    """No endpoint answered in time (refused, unreachable, timed out or unavailable)."""


class EtcdAuthError(EtcdError):
    """The user/password was rejected, or the user lacks permission for the request."""


class EtcdCompactedError(EtcdError):
    """A read or watch asked for a revision that etcd has already compacted away."""


class EtcdLeaseNotFoundError(EtcdError):
    """A write named a lease that does not exist (it expired or was revoked)."""


class EtcdLeaseExistsError(EtcdError):
    """A lease was granted with an id that another lease already has."""


class Fault(enum.Enum):
    """What a failed request tells the client about retrying it."""

    UNAVAILABLE = "unavailable"  # the member could not be reached: the request was not applied
    TIMED_OUT = "timed out"  # no answer in time: it may have been applied, so it is not retried
    UNAUTHENTICATED = "unauthenticated"  # the token expired or belongs to another member
    REFUSED = "refused"  # anything else etcd answered: retrying would not change the answer


# etcd uses INVALID_ARGUMENT for malformed requests (an empty key, too many operations in one
# transaction) and for these authentication errors, so only the message tells them apart:
# ErrGRPCAuthFailed ("authentication failed, invalid user ID or password"), ErrGRPCAuthOldRevision
# ("revision of auth store is old"), ErrGRPCPermissionNotGiven ("permission not given").
_AUTH_WORDS = ("auth", "permission")


def _status(exc: grpc.RpcError) -> tuple[grpc.StatusCode | None, str]:
    code = exc.code() if callable(getattr(exc, "code", None)) else None
    details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
    return code, details or ""


def _rpc_error(exc: BaseException | None) -> grpc.RpcError | None:
    """The gRPC error behind ``exc``: itself, or the one etcd3 was handling when it raised."""
    for candidate in (exc, getattr(exc, "__cause__", None), getattr(exc, "__context__", None)):
        if isinstance(candidate, grpc.RpcError):
            return candidate
    return None


def classify(exc: BaseException) -> Fault | None:
    """How a request failed with ``exc``; ``None`` when ``exc`` is no etcd3 or gRPC error."""
    if isinstance(exc, (etcd3.exceptions.ConnectionFailedError, etcd3.exceptions.NoServerAvailableError)):
        return Fault.UNAVAILABLE
    if isinstance(exc, (etcd3.exceptions.ConnectionTimeoutError, etcd3.exceptions.WatchTimedOut)):
        return Fault.TIMED_OUT
    if isinstance(exc, grpc.RpcError):
        code, _ = _status(exc)
        if code == grpc.StatusCode.UNAVAILABLE:
            return Fault.UNAVAILABLE
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return Fault.TIMED_OUT
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return Fault.UNAUTHENTICATED
        return Fault.REFUSED
    if isinstance(exc, etcd3.exceptions.Etcd3Exception):
        return Fault.REFUSED
    return None


def to_etcd_error(exc: BaseException, *, where: str, user: str | None, timeout: float) -> EtcdError:
    """The :class:`EtcdError` for ``exc`` (see :func:`classify`), raised by a request to the
    endpoints ``where`` as ``user`` with a ``timeout`` of that many seconds."""
    fault = classify(exc)
    if fault is Fault.UNAVAILABLE:
        return connection_error(where, "is unavailable", exc)
    if fault is Fault.TIMED_OUT:
        return connection_error(where, f"did not answer within {timeout:g} s")
    if not isinstance(exc, grpc.RpcError):
        return EtcdError(f"etcd at {where} failed a request: {exc!r}")
    code, details = _status(exc)
    # etcd answers OUT_OF_RANGE both for a compacted revision (ErrGRPCCompacted, "required revision
    # has been compacted") and for one in the future (ErrGRPCFutureRev).
    if code == grpc.StatusCode.OUT_OF_RANGE and "compacted" in details:
        return EtcdCompactedError(f"etcd at {where} has compacted the revision asked for: {details}")
    # NOT_FOUND, for the key/value and lease requests made here, is ErrGRPCLeaseNotFound.
    if code == grpc.StatusCode.NOT_FOUND:
        return EtcdLeaseNotFoundError(f"etcd at {where} does not know the lease: {details}")
    # etcd answers FAILED_PRECONDITION for several conditions (authentication not enabled, a
    # cluster version not capable, ...); ErrGRPCLeaseExist is "lease already exists".
    if code == grpc.StatusCode.FAILED_PRECONDITION and "lease already exists" in details:
        return EtcdLeaseExistsError(f"etcd at {where} already has the lease: {details}")
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) or (
        code == grpc.StatusCode.INVALID_ARGUMENT and any(word in details for word in _AUTH_WORDS)
    ):
        who = f"user {user!r}" if user is not None else "no user (auth may be enabled)"
        return EtcdAuthError(f"etcd at {where} refused the request for {who}: {details}")
    return EtcdError(f"etcd at {where} failed a request: {code}: {details}")


def connection_error(where: str, what: str, exc: BaseException | None = None) -> EtcdConnectionError:
    """``etcd at <where> <what>``, with why gRPC could not reach it when ``exc`` says."""
    reason = _unavailable_reason(exc) if exc is not None else ""
    return EtcdConnectionError(f"etcd at {where} {what}" + (f": {reason}." if reason else "."))


def _unavailable_reason(exc: BaseException) -> str:
    """Why gRPC could not reach etcd, in words; TLS handshake failures are named as such.

    A TLS failure looks like any other UNAVAILABLE to gRPC; without this the user would only
    read "unavailable" and look for a network problem instead of a wrong CA or a missing
    client certificate. gRPC has no status code of its own for these, so its message (from
    BoringSSL's error names) is all there is to go by.
    """
    rpc = _rpc_error(exc)
    details = _status(rpc)[1] if rpc is not None else ""
    if "CERTIFICATE_VERIFY_FAILED" in details:
        return (
            "TLS handshake failed: certificate verify failed (the server's certificate is not signed "
            "by the CA bundle given as ca_cert)"
        )
    if "BAD_CERTIFICATE" in details or "CERTIFICATE_REQUIRED" in details:
        return (
            "TLS handshake failed: the server rejected the client certificate (none was given, or it "
            "is not signed by a CA the server trusts; set ssl_cert and ssl_cert_key)"
        )
    if "handshake" in details.lower():
        return f"TLS handshake failed ({details})"
    return details


def describe(error: BaseException | None) -> str:
    """A failed stream's error in a few words, for a log line."""
    if isinstance(error, grpc.RpcError) and callable(getattr(error, "code", None)):
        return f"{error.code().name}: {error.details()}"
    return repr(error) if error is not None else "the server ended it"
