"""What a ``HiCachedStorage`` I/O method answers when it cannot do its work.

SGLang calls the storage from its prefetch and backup threads and does not expect
an exception there (``HiCacheFile`` raises none): a storage that is closed, a
daemon error, or an argument the daemon or the adapter cannot take (a key that is
not a string, host indices that are not page-aligned) is logged, rate-limited, and
answered as the call's miss: ``None`` / ``False`` / ``0`` / ``[False] * n``.

Pure functions and one decorator: thread-safe.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from hicached_client.errors import HiCacheError

__all__ = ["GIVE_UP", "Unsupported", "answers", "no_pages", "no_tensors", "no_transfers"]

F = TypeVar("F", bound=Callable[..., Any])

# A daemon that is down, or does not answer in time, fails every further ask of one call the
# same way, each after its own timeout: the call ends at the first such failure (its miss),
# not key by key (a generic batch_get of 128 keys took 129 timeouts).
GIVE_UP = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})

# What an argument of SGLang's can make the adapter or the client raise: a daemon's
# answer, a value it cannot take, a type it does not expect, a count that does not match.
FAILURES = (HiCacheError, ValueError, TypeError, IndexError)


class Unsupported(ValueError):
    """A call that HiCacheFile refuses with ValueError too (a hit policy neither knows):
    SGLang's configuration, not its data, so it is raised, as there."""


def _count(keys: Any) -> int:
    if isinstance(keys, str):
        return 1  # get / set / exists of one key
    try:
        return len(keys)
    except TypeError:
        return 0


def no_pages(keys: Any = None, *_: Any, **__: Any) -> list[bool]:
    return [False] * _count(keys)


def no_tensors(keys: Any = None, *_: Any, **__: Any) -> list[None]:
    return [None] * _count(keys)


def no_transfers(transfers: Any = None, *_: Any, **__: Any) -> dict[str, list[bool]]:
    try:
        return {str(t.name): [False] * _count(t.keys or []) for t in transfers or []}
    except (AttributeError, TypeError):
        return {}


def answers(miss: Callable[..., Any]) -> Callable[[F], F]:
    """Decorate a storage method: when its storage is closed or it raises one of
    :data:`FAILURES`, log (through the storage's ``failures`` RefusalLog) and return
    ``miss(*args, **kwargs)`` instead."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            if self.closed:
                self.failures.refused(fn.__name__, _count(args[0]) if args else 0, "the storage is closed")
                return miss(*args, **kwargs)
            try:
                return fn(self, *args, **kwargs)
            except Unsupported:
                raise
            except FAILURES as exc:
                self.failures.refused(
                    fn.__name__, _count(args[0]) if args else 0, f"{type(exc).__name__}: {exc}"
                )
                return miss(*args, **kwargs)

        return call  # type: ignore[return-value]

    return wrap
