"""Per-call page counts and bandwidths for SGLang's ``StorageMetrics`` (``get_stats``).

Thread-safety: :meth:`IoCounters.record` and :meth:`IoCounters.drain` may be
called from any thread (SGLang's prefetch and backup threads record, its
metrics collector drains).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

__all__ = ["IoCounters"]

_NAMES = ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth")


@dataclass
class IoCounters:
    """Per-call page counts and bandwidths since the last :meth:`drain`."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)

    def record(self, kind: str, pages: int, page_bytes: int, seconds: float) -> None:
        """One call of ``kind`` (``prefetch`` or ``backup``) that moved ``pages`` in ``seconds``."""
        gbps = pages * page_bytes / max(seconds, 1e-9) / 1e9
        with self.lock:
            getattr(self, f"{kind}_pgs").append(pages)
            getattr(self, f"{kind}_bandwidth").append(gbps)

    def drain(self) -> dict[str, list[Any]]:
        """Everything recorded since the last call (keyword arguments of ``StorageMetrics``)."""
        with self.lock:
            out: dict[str, list[Any]] = {}
            for name in _NAMES:
                out[name] = list(getattr(self, name))
                getattr(self, name).clear()
            return out
