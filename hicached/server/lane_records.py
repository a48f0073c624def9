"""A fast-lane record's transfers as the core's, and the core's answers as the record's (and
whether they fit one).

The transfers of a record are checked as the gRPC servicer checks a request's when it
converts them (:func:`hicached.server.convert.transfers_in`, then the pool names), in the
same order and with the same errors, so that an op answers alike over either transport.

Thread-safety: pure functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from hicached_client import lane_wire as w

from hicached.config import LimitsConfig
from hicached.core.types import Ack
from hicached.l2.group import PoolTransfer
from hicached.server.convert import check_transfer_count
from hicached.server.limits import check_pool_names

__all__ = ["acks_out", "check_answer_fits", "transfers_in", "transfers_out"]


def transfers_in(ts: Sequence[w.WireTransfer], limits: LimitsConfig) -> list[PoolTransfer]:
    """As ``convert.transfers_in`` and the servicer's pool-name check; an empty host list
    means "none given"."""
    check_transfer_count(len(ts), limits.max_pools_per_attach)
    check_pool_names("transfers", (t.pool for t in ts), limits)
    return [
        PoolTransfer(
            name=t.pool,
            device_indices=t.device if t.device is not None else np.empty(0, np.int64),
            host_indices=t.host if t.host is not None and len(t.host) else None,
            host_allocated=t.host_allocated,
        )
        for t in ts
    ]


def acks_out(acks: Sequence[Ack]) -> tuple[w.WireAck, ...]:
    return tuple(w.WireAck(a.pool, a.pages, a.tokens, a.bytes) for a in acks)


def transfers_out(ts: Sequence[PoolTransfer]) -> tuple[w.WireTransfer, ...]:
    return tuple(w.WireTransfer(t.name, t.device_indices, t.host_indices, t.host_allocated) for t in ts)


def check_answer_fits(req: w.Request, pools: int) -> None:
    """Refuse, before anything runs, a Write/Resolve whose answer might not fit its completion
    slot: once pages are allocated the answer must reach the client. Bound: one transfer per
    request transfer and per pool of the group (``pools``, derived ones included), each of at
    most twice the longest request transfer's pages (device and host), and the longest message."""
    longest = max(
        (max(len(t.device) if t.device is not None else 0, len(t.host) if t.host is not None else 0)
         for t in req.transfers),
        default=0,
    )  # fmt: skip
    rows = len(req.transfers) + pools
    need = w.COMPLETION.size + rows * (w.TRANSFER.size + 16 * longest + w.ACK.size)
    need += w.MAX_MESSAGE_BYTES - w.MESSAGE_BYTES  # a long reason's tail goes after the sections
    if need > w.AREA:
        raise w.RecordError(
            f"the answer to transfers of up to {longest} pages may not fit one lane completion "
            f"({w.AREA} bytes for {rows} pools): split the batch or use gRPC"
        )
