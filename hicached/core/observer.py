"""The core's observation seam: :class:`CoreObserver`, no-op by default.

Thread-safety: its methods run on the calling thread (an RPC's lane or the reaper) right after the
observed event, never under a core lock; an observer must be thread-safe, must not block and
must not raise. The Prometheus adapter is :class:`hicached.observability.CoreMetrics`.
"""

from __future__ import annotations

from typing import Protocol

from hicached.core.sessions import Session
from hicached.transfer.plan import CopyPlan, Direction

__all__ = ["CoreObserver", "NullCoreObserver"]


class CoreObserver(Protocol):
    """What the core reports: session lifecycle and finished copies."""

    def on_session(self, event: str, session: Session) -> None:
        """A session was attached, detached, replaced or expired (``event`` names which)."""

    def on_copy(self, direction: Direction, plan: CopyPlan, seconds: float, model: str = "") -> None:
        """A copy finished (``model``: the pool group's model name, for per-model metrics).
        ``plan`` is borrowed for the call: read it, do not keep it."""


class NullCoreObserver:
    """The default: observes nothing."""

    def on_session(self, event: str, session: Session) -> None:
        pass

    def on_copy(self, direction: Direction, plan: CopyPlan, seconds: float, model: str = "") -> None:
        pass
