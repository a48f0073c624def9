"""The keyed path's settings (:class:`KeyedOptions`) and the values it answers with.

Thread-safety: immutable values and a pure function.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hicached.config import Config
from hicached.core.types import Ack
from hicached.index.types import PrefetchPolicy
from hicached.l2.group import PoolTransfer

__all__ = ["KeyedOptions", "PutResult", "device_pages_at"]


@dataclass(frozen=True)
class KeyedOptions:
    """The settings the keyed path reads (from the configuration, by ``daemon.py``; immutable)."""

    max_batch_pages: int  # server.max_batch_pages: keys of one PutPages
    prefetch_policy: PrefetchPolicy  # l3.prefetch_policy: a prefetch that names none
    max_prefetches_per_session: int  # limits.max_prefetches_per_session
    max_prefetch_keys_per_peer: int = 1 << 20  # limits.max_prefetch_keys_per_peer
    has_l3: bool = False  # l3.backend is not "none"

    @classmethod
    def from_config(cls, cfg: Config) -> KeyedOptions:
        lim, l3 = cfg.limits, cfg.l3
        per_peer, has_l3 = lim.max_prefetch_keys_per_peer, l3.backend_config() is not None
        return cls(
            cfg.server.max_batch_pages, l3.prefetch_policy, lim.max_prefetches_per_session, per_peer, has_l3
        )


@dataclass(frozen=True)
class PutResult:
    ok: bool
    stored_pages: int = 0
    existing_pages: int = 0
    acks: tuple[Ack, ...] = ()
    # With ok False: why the daemon refused (sent to the worker).
    reason: str = ""


def device_pages_at(t: PoolTransfer, at: list[int]) -> PoolTransfer:
    """``t``'s device pages at the ascending positions ``at``, with no host pages (to be
    allocated); a slice when ``at`` is a whole tail (the common case: a new suffix)."""
    dev = t.device_indices
    if dev is not None and len(dev):  # a derived pool may leave its pages to its source's
        dev = dev[at[0] :] if len(at) == len(dev) - at[0] else dev[np.asarray(at, dtype=np.intp)]
    return PoolTransfer(t.name, device_indices=dev, host_indices=None)
