"""CoreHooks: the core's observation seam (metrics); no-op by default.

Hooks run on the calling thread after the observed event; they must not block or raise.
"""

from __future__ import annotations

from hicached.core.sessions import Session
from hicached.transfer.plan import CopyPlan, Direction


class CoreHooks:
    """Observation points (metrics); every hook is a no-op by default."""

    def on_session(self, event: str, session: Session) -> None:
        """A session was attached, detached, replaced or expired."""

    def on_copy(self, direction: Direction, plan: CopyPlan, seconds: float, model: str = "") -> None:
        """A copy finished (``model``: the pool group's model name, for per-model metrics)."""
