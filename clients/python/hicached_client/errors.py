"""The client's single exception type.

Every ``grpc.RpcError`` raised by any client method (sync or asyncio, unary or
streaming) is converted into :class:`HiCacheError`, which carries the status
code, the daemon's message and, for ``RESOURCE_EXHAUSTED``, the daemon's
``grpc-retry-pushback-ms`` hint. Local misuse (a wrong argument type, an index array
that is not 1-D, a token or session secret that is not valid gRPC metadata) raises
``TypeError`` / ``ValueError`` before anything is sent. A call on a closed client raises
:class:`ClientClosedError` (a :class:`HiCacheError`, ``CANCELLED``), and a call gRPC could not
start raises ``HiCacheError(INTERNAL)``: the same types from the blocking and the asyncio client.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import grpc

# gRPC's retry pushback key, which the daemon sends with RESOURCE_EXHAUSTED;
# daemons before the change sent the private "retry-after-ms", still read.
RETRY_AFTER_KEY = "grpc-retry-pushback-ms"
_LEGACY_RETRY_AFTER_KEY = "retry-after-ms"
# Heartbeat answers after which the lease is gone for good: stop beating.
LEASE_LOST_CODES = frozenset(
    {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED}
)
log = logging.getLogger(__name__)


def escape_controls(text: str) -> str:
    """``text`` with every non-printable character (``str.isprintable``: newline, CR, ESC and
    the other C0/C1 controls, DEL, line separators, bidi and other format characters) written
    as its Python escape (``\\n``, ``\\x1b``, ``\\u202e``): one line a log or a terminal shows
    as text. The daemon's words reach the worker's logs through this."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


class HiCacheError(Exception):
    """A failed call: ``code`` (``grpc.StatusCode``), ``message`` (the daemon's details).

    ``retry_after_ms`` is the daemon's hint of when a retry may succeed (sent
    with ``RESOURCE_EXHAUSTED``; below zero: do not retry, e.g. an UNAVAILABLE whose L3
    backend timed out), else ``None``. ``method`` names the RPC. ``message``
    is the daemon's text as sent; ``str()`` writes its controls escaped
    (:func:`escape_controls`), so a log line that formats the error stays one line.
    """

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        *,
        retry_after_ms: int | None = None,
        method: str = "",
    ) -> None:
        super().__init__(code, message)
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms
        self.method = method

    def __str__(self) -> str:
        where = f"{self.method}: " if self.method else ""
        retry = self.retry_after_ms
        hint = "" if retry is None else " (not to be retried)" if retry < 0 else f" (retry after {retry} ms)"
        return f"{where}{self.code.name}: {escape_controls(self.message)}{hint}"

    def __repr__(self) -> str:
        return f"HiCacheError({self.code.name}, {self.message!r}, retry_after_ms={self.retry_after_ms!r})"


def _retry_after(metadata: Iterable[Any] | None) -> int | None:
    for item in metadata or ():
        key, value = item[0], item[1]
        if key not in (RETRY_AFTER_KEY, _LEGACY_RETRY_AFTER_KEY):
            continue
        text = value.decode() if isinstance(value, bytes) else str(value)
        try:
            return int(text)
        except ValueError:
            # A malformed hint is not worth hiding the real error behind another one.
            return None
    return None


def from_rpc_error(error: grpc.RpcError, method: str = "") -> HiCacheError:
    """Convert a sync or asyncio ``grpc.RpcError`` (which is also a ``grpc.Call``)."""
    code_fn = getattr(error, "code", None)
    code = code_fn() if callable(code_fn) else grpc.StatusCode.UNKNOWN
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    details_fn = getattr(error, "details", None)
    details = details_fn() if callable(details_fn) else None
    trailing_fn = getattr(error, "trailing_metadata", None)
    trailing = trailing_fn() if callable(trailing_fn) else None
    return HiCacheError(
        code,
        details or str(error),
        retry_after_ms=_retry_after(trailing),
        method=method,
    )


def malformed_answer(method: str, what: str) -> HiCacheError:
    """An answer no daemon of ours sends (``what`` is wrong with it), as ``INTERNAL``, the code of
    the other answers the client cannot take (a stream without its final message): a result built
    from it would overstate hits or index past the keys asked."""
    return HiCacheError(grpc.StatusCode.INTERNAL, f"malformed {method} answer: {what}", method=method)


class ClientClosedError(HiCacheError):
    """A call on a client whose channel is closed (``client.close()``): ``CANCELLED``, nothing
    sent; or one that ``close()`` ended under way (the daemon may have run it)."""

    def __init__(self, method: str = "") -> None:
        super().__init__(grpc.StatusCode.CANCELLED, "the client is closed", method=method)


def start_failure(error: Exception, method: str, closed: bool) -> HiCacheError:
    """A call that gRPC refused to start (the sync channel's ``ValueError``, ``grpc.aio``'s
    ``UsageError`` / ``ExecuteBatchError``), as the one type both clients raise."""
    if closed:
        return ClientClosedError(method)
    return HiCacheError(
        grpc.StatusCode.INTERNAL, f"the call could not start: {type(error).__name__}: {error}", method=method
    )


# The shortest heartbeat period: a lease of a few ms (the daemon's answer) made the worker beat
# thousands of times a second on a core of its own (a daemon's minimum lease is 500 ms).
MIN_BEAT_S = 0.01


def beat_interval(lease_ms: int) -> float:
    """Seconds between heartbeats (and each one's deadline) for a lease of ``lease_ms``."""
    return max(lease_ms / 3000.0, MIN_BEAT_S)


def heartbeat_failure(error: Exception, session_id: str) -> HiCacheError | None:
    """Log a failed heartbeat; the error to keep as the session's ``lease_lost`` when the lease
    is gone for good (stop beating), None when it is transient (beat again)."""
    if not isinstance(error, HiCacheError):
        # Not a daemon answer: a bug or a broken channel. Retrying cannot help, and a beat that
        # stopped without a trace leaves the session to expire unnoticed.
        log.error("session %s heartbeat failed unexpectedly; it stops", session_id, exc_info=error)
        return HiCacheError(grpc.StatusCode.UNKNOWN, f"heartbeat failed: {error!r}", method="Heartbeat")
    if error.code in LEASE_LOST_CODES or isinstance(error, ClientClosedError):
        log.error("session %s lost its lease: %s", session_id, error)
        return error
    log.warning("session %s heartbeat failed (will retry): %s", session_id, error)
    return None
