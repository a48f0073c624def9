"""Admission of a Prefetch: per session (``limits.max_prefetches_per_session`` running or
queued) and per peer (the keys their plans hold, ``limits.max_prefetch_keys_per_peer``).

A Prefetch is answered at once, and its task keeps its plan (every key it will read from L3)
until it finishes: about 150 bytes a 64-hex key (a 65,536-key plan ~10 MiB, measured). The
per-session bound (``limits.max_prefetches_per_session``) leaves a peer 256 sessions of 16
plans each (a review: +505 MiB from 58 of them, ~45 GiB reachable). So each peer's plans
together hold at most this many keys; a peer holding none is always admitted (one plan is
at most ``limits.max_keys_per_request``).

No callback from the task is needed to give keys back: a finished task is dropped from its
peer's count the next time that peer asks, so a task that never finishes stays counted,
as its keys stay in memory.

Thread-safety: every method may be called from any thread (one lock, never held while
calling out, except to ask a task whether it finished).
"""

from __future__ import annotations

import threading

from hicached.errors import ResourceExhausted
from hicached.index.jobs import PrefetchTask

__all__ = ["PrefetchAdmission"]

RETRY_AFTER_MS = 100  # when a refused client may ask again


class _Planning:
    """A prefetch admitted and still making its plan (no task yet)."""


class PrefetchAdmission:
    """The prefetches each session runs, and the planned keys of each peer's, within bounds."""

    def __init__(self, per_session: int, keys_per_peer: int) -> None:
        self._per_session = per_session
        self._limit = keys_per_peer
        self._lock = threading.Lock()
        self._held: dict[str, dict[_Planning | PrefetchTask, int]] = {}

    def admit(self, peer: str, running: int, keys: int) -> _Planning:
        """Admit a prefetch of ``keys`` keys by a session of ``peer`` that has ``running`` running
        or queued, counting its keys while it is planned; ResourceExhausted (retry hint) past
        either bound. Pass the ticket to :meth:`started` or :meth:`release`."""
        if running >= self._per_session:
            raise ResourceExhausted(
                f"this session has {running} prefetches running or queued, the most "
                f"limits.max_prefetches_per_session={self._per_session} allows: wait for one "
                "(PrefetchStatus) or cancel one",
                retry_after_ms=RETRY_AFTER_MS,
            )
        ticket = _Planning()
        with self._lock:
            mine = self._held.setdefault(peer, {})
            for task in [t for t in mine if isinstance(t, PrefetchTask) and t.finished]:
                del mine[task]
            held = sum(mine.values())
            if held and held + keys > self._limit:
                raise ResourceExhausted(
                    f"this peer's running prefetches plan {held} keys; {keys} more would pass "
                    f"limits.max_prefetch_keys_per_peer={self._limit}: wait for one (PrefetchStatus) "
                    "or cancel one",
                    retry_after_ms=RETRY_AFTER_MS,
                )
            mine[ticket] = keys
        return ticket

    def started(self, peer: str, ticket: _Planning, task: PrefetchTask) -> None:
        """The plan is made: ``task`` holds its planned keys until it finishes."""
        with self._lock:
            mine = self._held.setdefault(peer, {})
            mine.pop(ticket, None)
            if task.planned_pages:
                mine[task] = task.planned_pages
            elif not mine:
                del self._held[peer]

    def release(self, peer: str, ticket: _Planning) -> None:
        """The prefetch was not started (refused, failed): its keys are not held."""
        with self._lock:
            mine = self._held.get(peer)
            if mine is not None:
                mine.pop(ticket, None)
                if not mine:
                    del self._held[peer]
