"""Two worker processes share a prompt prefix through the daemon.

Worker A computes the KV of a prefix, writes it to host memory and publishes it
under the prefix's token ids, then exits. Worker B, another process with its own
device pool but the same model and layout (so the same pool group), looks the
prefix up and loads it into its own device pages; the bytes are A's.

    hicached serve --socket "$HICACHED_SOCKET"     # in another terminal
    python examples/two_workers.py
"""

import hashlib
import os
import uuid
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch
from hicached_client import HiCacheClient, TokenChain, Transfer, WorkerIdentity, pool_spec
from hicached_client.export import ShmKVPool

LAYERS, HEADS, HEAD_DIM, PAGE = 2, 4, 64, 16
MODEL = "example-model-shared"
PREFIX_PAGES = 4


def device_pool(worker: str) -> ShmKVPool:
    # Named after the example's main process (the parent of this worker process).
    return ShmKVPool(
        f"hicached-example-{os.getppid()}-{worker}",
        num_layers=LAYERS,
        tokens=64 * PAGE,
        heads=HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.bfloat16,
    )


def spec(kv: ShmKVPool):
    return pool_spec(
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


def digest(kv: ShmKVPool, pages: list[int]) -> str:
    """SHA-256 of the given device pages (every layer, K and V)."""
    h = hashlib.sha256()
    for t in (*kv.k, *kv.v):
        for p in pages:
            h.update(t[p * PAGE : (p + 1) * PAGE].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def worker_a(prefix: TokenChain) -> str:
    with device_pool("a") as kv, HiCacheClient() as client:
        for t in (*kv.k, *kv.v):
            t.normal_()  # the prefix's KV, as a forward pass would have written it
        pages = list(range(5, 5 + PREFIX_PAGES))
        with client.attach(WorkerIdentity("example-worker-a", 1, MODEL), [spec(kv)]) as session:
            written = session.write([Transfer("kv", pages)], allocate=True)
            assert written.ok, "no host room"
            published = session.publish(prefix, written.transfers)
            assert published.published_pages == PREFIX_PAGES, published
        return digest(kv, pages)


def worker_b(prefix: TokenChain) -> tuple[str, bool, int]:
    with device_pool("b") as kv, HiCacheClient() as client:
        pages = list(range(40, 40 + PREFIX_PAGES))
        with client.attach(WorkerIdentity("example-worker-b", 1, MODEL), [spec(kv)]) as session:
            found = session.lookup(prefix)
            got = session.get_pages(prefix, [Transfer("kv", pages)])
            assert got.hit_pages == found.total_hit_pages == PREFIX_PAGES, (found, got)
            return digest(kv, pages), session.info.joined_existing_group, found.l2_hit_pages


def main() -> None:
    # A fresh prefix each run (the salt namespaces its keys), so A really publishes new pages.
    prefix = TokenChain(list(range(100, 100 + PREFIX_PAGES * PAGE)), cache_salt=uuid.uuid4().hex)
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        a_digest = pool.submit(worker_a, prefix).result()
        print(f"verified: worker A (its own process) published {PREFIX_PAGES} pages of the prefix")
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        b_digest, joined, in_l2 = pool.submit(worker_b, prefix).result()
    assert joined, "worker B should have joined worker A's pool group"
    assert b_digest == a_digest, "worker B loaded different bytes"
    print(f"verified: worker B joined A's pool group, found the prefix ({in_l2} pages in host memory)")
    print(f"verified: worker B loaded A's {PREFIX_PAGES} pages byte for byte (sha256 {a_digest[:16]}...)")


if __name__ == "__main__":
    main()
