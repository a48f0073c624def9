"""The content index's write and prefetch policies, by SGLang's names.

A room of its own, below both the configuration (which names them) and the index (which
follows them), so that reading a configuration imports neither the index nor the pools it
sits on (torch: over a second of every CLI command's start).
"""

from __future__ import annotations

import enum

__all__ = ["PrefetchPolicy", "WritePolicy"]


class WritePolicy(enum.StrEnum):
    """When an L2 page is backed up to L3 (SGLang's names).

    * ``WRITE_THROUGH``: on first use, i.e. as soon as it is published.
    * ``WRITE_THROUGH_SELECTIVE``: on its second hit (a pin or a duplicate publish).
    * ``WRITE_BACK``: only when it is evicted from L2 (or when the index is flushed);
      the index evicts ahead of need in the background so the write rarely
      sits on an allocation's path.
    """

    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"


class PrefetchPolicy(enum.StrEnum):
    """How long a worker waits for an L3 -> L2 prefetch (SGLang's names).

    * ``BEST_EFFORT``: never waits; the prefetch carries on in the background.
    * ``WAIT_COMPLETE``: waits until every planned page is in L2 (or it failed).
    * ``TIMEOUT``: waits until done or the deadline of :func:`prefetch_deadline_s`;
      at the deadline the prefetch stops starting new batches.
    """

    BEST_EFFORT = "best_effort"
    WAIT_COMPLETE = "wait_complete"
    TIMEOUT = "timeout"
