"""The checkpoint package's exceptions, and one-line descriptions of failures for logs and messages."""

from __future__ import annotations

import errno
from typing import Any


class CheckpointError(RuntimeError):
    """A checkpoint cannot be found, verified, written or used. The message names it and says why."""


class CheckpointVerificationError(CheckpointError):
    """A checkpoint file does not match its manifest. ``bad_file`` names the file, ``reason`` says how."""

    def __init__(self, message: str, bad_file: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.bad_file = bad_file
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:
        # Sent between ranks with its fields (the default pickles only the message).
        return type(self), (str(self), self.bad_file, self.reason)


class ExportError(ValueError):
    """An object of a checkpoint cannot be written in the export format asked for, or reading it from
    the checkpoint failed; the message names the object and why (a failed read chains the
    :class:`CheckpointVerificationError` naming the file)."""


_PLAIN_WORDS = {
    errno.ENOSPC: "is full",
    errno.EDQUOT: "is over its quota",
    errno.EROFS: "is read-only",
}


def _os_error(exc: BaseException) -> OSError | None:
    """The innermost OSError with an errno in ``exc``'s cause chain (client errors are wrapped)."""
    found = None
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno is not None:
            found = exc
        exc = exc.__cause__ or exc.__context__
    return found


def describe_error(exc: BaseException, url: str = "") -> str:
    """One line for ``exc``; a full disk (and the like) is said in plain words naming ``url``.

    ``ENOSPC`` becomes "the disk holding URL is full (...)": the raw text of a failed write
    ("[Errno 28] No space left on device", or worse a serializer's "unexpected pos") does not tell
    a user what to do.
    """
    text = str(exc) if isinstance(exc, (RuntimeError, OSError)) else f"{type(exc).__name__}: {exc}"
    os_error = _os_error(exc)
    if os_error is not None and os_error.errno in _PLAIN_WORDS:
        where = url or os_error.filename or "the checkpoint"
        return f"the disk holding {where} {_PLAIN_WORDS[os_error.errno]} ({errno.errorcode[os_error.errno]}: {text})"
    return text
