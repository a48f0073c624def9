"""A worker on the local daemon with the asyncio client.

It writes four device pages to host memory, then runs two loads back into the
device pool concurrently, following each layer as it lands (where an engine
would start that layer's forward), and checks every byte.

    hicached serve --socket "$HICACHED_SOCKET"     # in another terminal
    python examples/async_worker.py
"""

import asyncio
import os

import torch
from hicached_client import AsyncHiCacheClient, Transfer, WorkerIdentity, pool_spec
from hicached_client.export import ShmKVPool

LAYERS, HEADS, HEAD_DIM, PAGE = 4, 4, 64, 16


async def load_following_layers(session, device_pages, host_pages) -> list[int]:
    """Load host pages into device pages; returns the layers in the order they were ready."""
    ready = []
    async for step in session.load([Transfer("kv", device_pages, host_pages)]):
        if not step.done:
            ready.append(step.layer)  # layer `step.layer` of every page is in device memory now
    return ready


async def main() -> None:
    with ShmKVPool(
        f"hicached-example-{os.getpid()}-kv",
        num_layers=LAYERS,
        tokens=64 * PAGE,
        heads=HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.bfloat16,
    ) as kv:
        for t in (*kv.k, *kv.v):
            t.normal_()
        spec = pool_spec(
            "kv",
            role="anchor",
            kind="mha",
            dtype="bfloat16",
            page_size=PAGE,
            num_layers=LAYERS,
            num_heads=HEADS,
            head_dim=HEAD_DIM,
            k_buffers=kv.k_buffers(),
            v_buffers=kv.v_buffers(),
        )
        async with AsyncHiCacheClient() as client:
            identity = WorkerIdentity("example-async-worker", generation=1, model_name="example-model-async")
            async with await client.attach(identity, [spec]) as session:
                written = await session.write([Transfer("kv", [0, 1, 2, 3])], allocate=True)
                assert written.ok, "no host room"
                host = list(written.transfers[0].host_pages)
                first, second = await asyncio.gather(
                    load_following_layers(session, [20, 21], host[:2]),
                    load_following_layers(session, [30, 31], host[2:]),
                )
                for t in (*kv.k, *kv.v):
                    assert torch.equal(t[20 * PAGE : 22 * PAGE], t[0 : 2 * PAGE])
                    assert torch.equal(t[30 * PAGE : 32 * PAGE], t[2 * PAGE : 4 * PAGE])
                assert sorted(first) == sorted(second) == list(range(LAYERS)), (first, second)
                print(f"verified: two concurrent loads, layers ready in order {first} and {second}")
                print("verified: 4 pages back in device memory byte for byte")
                await session.release_transfers(written.transfers)  # hand the host pages back


if __name__ == "__main__":
    asyncio.run(main())
