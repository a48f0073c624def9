"""The daemon's page lists from the wire: the same int64 array whichever way they are read
(walked up to ``SMALL_BATCH``, handed to numpy whole above it), int64 extremes included."""

from __future__ import annotations

import numpy as np
import pytest
from hicached_client.v1 import types_pb2 as tpb

from hicached.errors import InvalidArgument
from hicached.page_arrays import SMALL_BATCH
from hicached.server import convert
from hicached.server.convert import pages_in


@pytest.mark.parametrize("n", [0, 1, SMALL_BATCH, SMALL_BATCH + 1, 1000])
def test_page_lists_from_the_wire_are_their_values_as_int64(n: int) -> None:
    values = [(-1) ** i * (2**63 - 1 - i) for i in range(n)]
    got = pages_in(tpb.PoolTransfer(pool="kv", device_pages=values).device_pages)
    assert got.dtype == np.int64 and got.shape == (n,)
    assert got.tolist() == values


def test_the_page_count_of_a_batch_counts_its_primary_pages_with_its_transfers() -> None:
    """Fails before (a review of this stop's change): the primary pages were taken off the
    limit instead, so the refusal read "batch of 5 pages exceeds server.max_batch_pages=2"."""
    batch = tpb.TransferBatch(
        primary_device_pages=list(range(6)),
        transfers=[tpb.PoolTransfer(pool="x", device_pages=list(range(5)))],
    )
    with pytest.raises(InvalidArgument, match=r"batch of 11 pages exceeds server.max_batch_pages=8"):
        convert.batch_in(batch, "kv", max_pools=32, max_pages=8)
