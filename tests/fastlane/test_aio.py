"""The asyncio lane: byte-exact Write/Load without blocking the event loop, gRPC's errors."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest
from hicached_client import AsyncHiCacheClient, HiCacheError, Transfer, WorkerIdentity
from hicached_client.fastlane_aio import AsyncFastLane

from tests.support.daemon import Daemon
from tests.support.kv import WorkerPools, unique_tag


def test_async_lane_write_and_load_are_byte_exact(daemon: Daemon) -> None:
    pools = WorkerPools.create(unique_tag("flaio"))
    try:
        pools.fill_random(31)
        src, dst = list(range(16)), list(range(600, 616))
        expected = pools.pages("kv", src).clone()

        async def main() -> tuple[int, ...]:
            async with AsyncHiCacheClient(daemon.target, timeout_s=30.0) as client:
                session = await client.attach(
                    WorkerIdentity(f"aio-{uuid.uuid4().hex[:6]}", 1, "m-fastlane"), pools.specs()
                )
                try:
                    async with await AsyncFastLane.open(session) as lane:
                        ticks = 0

                        async def ticker() -> None:  # the loop keeps running while the lane waits
                            nonlocal ticks
                            while True:
                                ticks += 1
                                await asyncio.sleep(0)

                        tick = asyncio.create_task(ticker())
                        w = await lane.write([Transfer("kv", src)], allocate=True)
                        pools.clobber()
                        r = await lane.load([Transfer("kv", dst, w.transfers[0].host_pages)])
                        tick.cancel()
                        assert ticks > 0
                        with pytest.raises(HiCacheError) as err:
                            await lane.write([Transfer("kv", [5000])], allocate=True)
                        assert err.value.code == grpc.StatusCode.OUT_OF_RANGE
                        assert await lane.release_transfers(list(w.transfers)) == 16
                        return r.layers
                finally:
                    await session.close()

        assert asyncio.run(main()) == (0, 1)
        assert bool((pools.pages("kv", dst) == expected).all())
    finally:
        for p in (pools.kv, pools.draft):
            p.close()
            p.unlink()
