"""The one table from daemon exceptions to gRPC status codes.

Every servicer method goes through :func:`status_for`; the client maps codes
back to its single ``HiCacheError``. Order matters: the first matching class
wins, so subclasses come before their bases.
"""

from __future__ import annotations

import errno
from typing import Any

import grpc

from hicached import errors

STATUS_TABLE: tuple[tuple[type[Any], grpc.StatusCode], ...] = (
    (errors.OutOfRange, grpc.StatusCode.OUT_OF_RANGE),
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.Unimplemented, grpc.StatusCode.UNIMPLEMENTED),
    (errors.Cancelled, grpc.StatusCode.CANCELLED),
    (errors.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
)


class _ExhaustedOSError(type):
    """``isinstance(exc, ExhaustedOSError)``: an OSError whose errno says a resource ran out."""

    ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOSPC})

    def __instancecheck__(cls, exc: object) -> bool:
        return isinstance(exc, OSError) and exc.errno in cls.ERRNOS


class ExhaustedOSError(metaclass=_ExhaustedOSError):
    """Out of descriptors (EMFILE/ENFILE), memory (ENOMEM) or space (ENOSPC): the
    daemon's resources, not the request, are at fault; a retry may succeed."""


STATUS_TABLE += ((ExhaustedOSError, grpc.StatusCode.RESOURCE_EXHAUSTED),)

# gRPC's own retry-hint key: a channel whose service config retries the code
# waits this long before its next attempt (and a negative or absent value means
# "do not retry"); clients read it into ``HiCacheError.retry_after_ms``. Earlier
# daemons sent a private "retry-after-ms" key instead.
RETRY_AFTER_KEY = "grpc-retry-pushback-ms"


def status_for(exc: BaseException) -> grpc.StatusCode | None:
    """The status code of a daemon error; None for anything else (a bug: INTERNAL)."""
    for cls, code in STATUS_TABLE:
        if isinstance(exc, cls):
            return code
    return None


def trailing_metadata_for(exc: BaseException) -> tuple[tuple[str, str], ...]:
    retry = getattr(exc, "retry_after_ms", None)
    if retry is not None:
        return ((RETRY_AFTER_KEY, str(int(retry))),)
    return ()
