"""Daemon exceptions to the answer a client gets: status code, message and retry hint.

Each error class of :mod:`hicached.errors` carries the name of its code (``code``),
inherited by its subclasses unless they name their own: the most derived class
decides, so no table order can map a subclass to its base's code. Every failed RPC is
answered by :func:`answer_for`, on both transports: the error interceptor
(:mod:`hicached.server.interceptors`) sends its answer as a gRPC status, the fast lane
(:mod:`hicached.server.lane`) writes the same answer into its completion, so a client sees
the same code, message and hint whichever way its call went (docs/fastlane.md). The client
maps codes back to its single ``HiCacheError``. Thread-safety: pure functions.
"""

from __future__ import annotations

import errno
from typing import NamedTuple

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
# An error message longer than this is cut: gRPC carries it in a header, and the lane in
# its completion slot (hicached_client.lane_wire.MAX_MESSAGE_BYTES holds its UTF-8).
MAX_MESSAGE_CHARS = 1024


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


def retry_after_ms_of(exc: BaseException) -> int | None:
    """The retry hint ``exc`` carries (a :class:`~hicached.errors.RetryHinted`), in milliseconds; None if none."""
    retry = getattr(exc, "retry_after_ms", None)
    return None if retry is None else int(retry)


def trailing_metadata_for(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """gRPC's trailing metadata for ``exc``: its retry hint, if it has one."""
    retry = retry_after_ms_of(exc)
    return () if retry is None else ((RETRY_AFTER_KEY, str(retry)),)


class Answer(NamedTuple):
    """What a client is told of a failed call, whichever transport carried it.

    ``log_it``: the error is a bug (answered INTERNAL): the caller logs it with its traceback,
    naming the method. A daemon error is the client's answer, not the operator's concern.
    """

    code: grpc.StatusCode
    message: str
    retry_after_ms: int | None
    log_it: bool


def answer_for(exc: BaseException, method: str) -> Answer:
    """The answer to a call of ``method`` (the RPC's name, e.g. ``Write``) that raised ``exc``.

    A daemon error keeps its message; an exhausted resource (:func:`exhausted_os_error`) says
    which and what to do; anything else is a bug: INTERNAL naming the method. The message is
    cut at ``MAX_MESSAGE_CHARS`` characters, its full length said.
    """
    code = status_for(exc)
    log_it = code is None
    if code is None:
        code, message = grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}: {exc}"
    elif isinstance(exc, OSError) and exc.errno is not None:
        # The daemon's own resources ran out: say which, and where the operator looks.
        name = errno.errorcode.get(exc.errno, str(exc.errno))
        message = (
            f"the daemon is out of resources in {method}: {name} ({exc.strerror}); retry later "
            "(descriptors: its RLIMIT_NOFILE; memory: host.budget; space: the L3 disk)"
        )
    else:
        message = str(exc)
    return Answer(code, cut_message(message), retry_after_ms_of(exc), log_it)


def cut_message(message: str) -> str:
    """``message``, or its first ``MAX_MESSAGE_CHARS`` characters and its length when longer."""
    if len(message) > MAX_MESSAGE_CHARS:
        return message[:MAX_MESSAGE_CHARS] + f"... ({len(message)} chars)"
    return message
