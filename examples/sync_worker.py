"""A worker on the local daemon with the sync client.

It writes three of its device pages to host memory (L2), loads them back into
other device pages and checks them byte for byte, then publishes them under
the token ids of a prompt prefix and looks that prefix up.

    hicached serve --socket "$HICACHED_SOCKET"     # in another terminal
    python examples/sync_worker.py

The "device" pool lives in shared memory (a CPU stand-in for GPU memory); it is
removed when the ``with`` block ends, so the example can run again and again.
"""

import os

import torch
from hicached_client import HiCacheClient, TokenChain, Transfer, WorkerIdentity, pool_spec
from hicached_client.export import ShmKVPool

LAYERS, HEADS, HEAD_DIM, PAGE = 2, 4, 64, 16  # 32 KiB pages in bfloat16


def main() -> None:
    with (
        ShmKVPool(
            f"hicached-example-{os.getpid()}-kv",
            num_layers=LAYERS,
            tokens=64 * PAGE,
            heads=HEADS,
            head_dim=HEAD_DIM,
            dtype=torch.bfloat16,
        ) as kv,
        HiCacheClient() as client,  # $HICACHED_SOCKET, else the daemon's default socket
    ):
        for t in (*kv.k, *kv.v):
            t.normal_()  # stands in for what a forward pass wrote
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
        identity = WorkerIdentity("example-sync-worker", generation=1, model_name="example-model")
        with client.attach(identity, [spec]) as session:  # detaches at the end of the block
            written = session.write([Transfer("kv", [3, 4, 5])], allocate=True)  # device -> host
            assert written.ok, "no host room"
            host = written.transfers[0].host_pages
            session.load_wait([Transfer("kv", [10, 11, 12], host)])  # host -> device, per layer
            for t in (*kv.k, *kv.v):
                assert torch.equal(t[10 * PAGE : 13 * PAGE], t[3 * PAGE : 6 * PAGE])
            print(f"verified: device pages 3-5 went to host pages {list(host)} and came back as 10-12")

            prefix = TokenChain(list(range(7000, 7000 + 3 * PAGE)))  # a 48-token prompt prefix
            published = session.publish(prefix, written.transfers)
            print(
                f"verified: published the prefix ({published.published_pages} new pages, "
                f"{published.existing_pages} already cached by an earlier run)"
            )
            found = session.lookup(prefix)
            assert found.total_hit_pages == 3, found
            print(f"verified: lookup finds all 3 pages ({found.l2_hit_pages} in host memory)")


if __name__ == "__main__":
    main()
