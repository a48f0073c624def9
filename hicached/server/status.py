"""Daemon exceptions to gRPC status codes.

Each error class of :mod:`hicached.errors` carries the name of its code (``code``),
inherited by its subclasses unless they name their own: the most derived class
decides, so no table order can map a subclass to its base's code. Every RPC goes
through :func:`status_for` (the error interceptor, :mod:`hicached.server.interceptors`,
and the fast lane); the client maps codes back to its single ``HiCacheError``.
"""

from __future__ import annotations

import errno

import grpc

from hicached import errors

# An OSError with one of these errnos means the daemon's own resources ran out
# (descriptors EMFILE/ENFILE, memory ENOMEM, space ENOSPC), not that the request is
# at fault: RESOURCE_EXHAUSTED, and a retry may succeed.
EXHAUSTED_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOSPC})

# gRPC's own retry-hint key: a channel whose service config retries the code
# waits this long before its next attempt (and a negative or absent value means
# "do not retry"); clients read it into ``HiCacheError.retry_after_ms``. Earlier
# daemons sent a private "retry-after-ms" key instead.
RETRY_AFTER_KEY = "grpc-retry-pushback-ms"


def exhausted_os_error(exc: BaseException) -> bool:
    """An OSError whose errno says one of the daemon's resources ran out."""
    return isinstance(exc, OSError) and exc.errno in EXHAUSTED_ERRNOS


def status_for(exc: BaseException) -> grpc.StatusCode | None:
    """The status code of a daemon error; None for anything else (a bug: INTERNAL)."""
    if isinstance(exc, errors.HiCacheError):
        name = type(exc).code
        return grpc.StatusCode[name] if name is not None else None
    if exhausted_os_error(exc):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    return None


def trailing_metadata_for(exc: BaseException) -> tuple[tuple[str, str], ...]:
    retry = getattr(exc, "retry_after_ms", None)
    if retry is not None:
        return ((RETRY_AFTER_KEY, str(int(retry))),)
    return ()
