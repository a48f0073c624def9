"""The daemon's exception types (pure: no gRPC, no torch).

Programming errors and bad input are exceptions; expected outcomes (no host
room, cache miss, backpressure that a caller can wait out) are return values.
Each class carries the name of its gRPC status code (``code``, a
``grpc.StatusCode`` member name, so this module stays free of gRPC); a
subclass inherits its base's code unless it names its own, so the mapping
cannot depend on the order anything is listed in (python-api-core's
``grpc_status_code`` idea). ``hicached.server.status`` turns the name into the
status. Every message must name the offending value so that a person can act
on it, and a raised error must leave the object it was raised from unchanged.
"""

from __future__ import annotations

from typing import ClassVar


class HiCacheError(Exception):
    """Base of every error the daemon reports to a caller; raised as such it is a bug
    (no code: the server answers INTERNAL and logs it)."""

    code: ClassVar[str | None] = None


# A retry hint that tells a gRPC client not to retry (``grpc-retry-pushback-ms`` below zero).
NO_RETRY = -1


class InvalidArgument(HiCacheError, ValueError):
    """Malformed input: shapes, lengths, alignment, duplicate indices, bad handles."""

    code = "INVALID_ARGUMENT"


class OutOfRange(InvalidArgument):
    """An index beyond the bounds of the object it addresses."""

    code = "OUT_OF_RANGE"


class NotFound(HiCacheError, KeyError):
    """Unknown session, pool, backup, prefetch or shared-memory segment."""

    code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class AlreadyExists(HiCacheError):
    """A name that must be unique is taken (pool names, anchors)."""

    code = "ALREADY_EXISTS"


class FailedPrecondition(HiCacheError):
    """Valid request, wrong state: stale generation, double free, double alloc."""

    code = "FAILED_PRECONDITION"


class DoubleFree(FailedPrecondition):
    """Freeing a page that is not allocated."""


class RetryHinted(Exception):
    """Mixed into an error class that may carry ``retry_after_ms``: the hint gRPC clients'
    retries follow (sent as ``grpc-retry-pushback-ms``; :data:`NO_RETRY`: do not retry)."""

    def __init__(self, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class ResourceExhausted(RetryHinted, HiCacheError):
    """Backpressure or budget; ``retry_after_ms`` says when a retry may succeed."""

    code = "RESOURCE_EXHAUSTED"


class PermissionDenied(HiCacheError):
    """The caller may not touch this object (another session's, another tenant's)."""

    code = "PERMISSION_DENIED"


class Unauthenticated(HiCacheError):
    """Missing or wrong credentials."""

    code = "UNAUTHENTICATED"


class Unavailable(RetryHinted, HiCacheError):
    """The daemon is draining or shutting down, or its L3 backend failed; :data:`NO_RETRY`
    for a failure that the channel re-sending the call at once would only repeat (a hung
    backend's timeout)."""

    code = "UNAVAILABLE"


class Unimplemented(HiCacheError):
    """A valid request for something this build does not do yet."""

    code = "UNIMPLEMENTED"


class Cancelled(HiCacheError):
    """The operation was cancelled (session ended, prefetch cancelled)."""

    code = "CANCELLED"


CLIP_CHARS = 32


def clip(value: object, limit: int = CLIP_CHARS) -> str:
    """A client value as an error message may quote it: ``repr`` of at most ``limit``
    characters, with the full length named when cut (``'abc…' (100000 chars)``).

    Every message that echoes a client value goes through this, so a 100 KB id cannot
    turn an answer into "metadata size exceeds limit".
    """
    if isinstance(value, bytes | bytearray):
        if len(value) <= limit:
            return repr(bytes(value))
        return f"{bytes(value[:limit])!r}... ({len(value)} bytes)"
    if isinstance(value, int | float) and not isinstance(value, bool):  # a number, unquoted
        text = str(value)
        return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} chars)"


class LimitExceeded(ResourceExhausted):
    """A configured limit (``[limits]``) refuses a request before any work starts.

    ``key`` is the configuration key that states the limit; the message names it.
    No ``retry_after_ms``: the same request is refused again until the limit changes.
    """

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


class StartupError(Exception):
    """The daemon cannot start as configured (an L3 backend that cannot start, a socket that
    is another daemon's, a directory others could write): the message is one actionable line,
    naming the key to fix, and ``hicached serve`` exits 2. Not a caller's error: no code."""
