"""Byte-only sessions: a client without shared memory (e.g. remote over TCP) attaches pools
with no device buffers and moves pages as bytes, sharing them with shm workers of the group."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import grpc
import pytest
import torch
from hicached_client import HiCacheClient, HiCacheError, PageBytes, Transfer, WorkerIdentity, pool_spec
from hicached_client.export import ShmKVPool
from hicached_client.v1 import types_pb2 as tpb

from tests.support.daemon import Daemon

LAYERS, HEADS, DIM, PAGE = 2, 2, 16, 4
TOKENS = 64 * PAGE
PAGE_BYTES = 2 * LAYERS * PAGE * HEADS * DIM * 2  # K and V, bf16
MODEL = "m-bytes"


def spec(kv: ShmKVPool | None) -> tpb.PoolSpec:
    return pool_spec(
        "kv", role="anchor", kind="mha", dtype="bfloat16", page_size=PAGE, num_layers=LAYERS,
        num_heads=HEADS, head_dim=DIM, host_layout="layer_first",
        k_buffers=kv.k_buffers() if kv else (), v_buffers=kv.v_buffers() if kv else (),
        host_bytes=256 * PAGE_BYTES,
    )  # fmt: skip


def flat_page(kv: ShmKVPool, page: int) -> bytes:
    """A host page's flat bytes in layer_first order: K of each layer, then V of each layer."""
    rows = slice(page * PAGE, (page + 1) * PAGE)
    return b"".join(t[rows].contiguous().view(torch.uint8).numpy().tobytes() for t in (*kv.k, *kv.v))


@pytest.fixture
def worker() -> Iterator[ShmKVPool]:
    kv = ShmKVPool(f"hcb-{uuid.uuid4().hex[:8]}", num_layers=LAYERS, tokens=TOKENS, heads=HEADS, head_dim=DIM,
                   dtype=torch.bfloat16)  # fmt: skip
    for t in (*kv.k, *kv.v):
        t.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, t.shape, dtype=torch.int16))
    try:
        yield kv
    finally:
        kv.close()
        kv.unlink()


def test_byte_only_session_shares_pages_with_a_shm_worker(daemon: Daemon, worker: ShmKVPool) -> None:
    keys = [uuid.uuid4().hex for _ in range(6)]
    with HiCacheClient(daemon.target) as client:
        a = client.attach(WorkerIdentity("shm-worker", 1, MODEL), [spec(worker)])
        b = client.attach(WorkerIdentity("byte-client", 1, MODEL), [spec(None)])
        assert b.info.joined_existing_group  # same model and pool layout: one group
        assert a.put_pages(keys[:3], [Transfer("kv", [7, 8, 9])]).stored_pages == 3
        got = b.get_bytes(keys[:3])
        assert got.hit_pages == 3
        assert [p.data for p in got.pages] == [flat_page(worker, p) for p in (7, 8, 9)]

        # The other way round: bytes in, device pages out.
        blobs = [flat_page(worker, p) for p in (1, 2, 3)]
        assert (
            b.put_bytes([PageBytes(k, "kv", d) for k, d in zip(keys[3:], blobs, strict=True)]).stored_pages
            == 3
        )
        for t in (*worker.k, *worker.v):
            t[40 * PAGE : 43 * PAGE].view(torch.int16).fill_(0)
        assert a.get_pages(keys[3:], [Transfer("kv", [40, 41, 42])]).hit_pages == 3
        assert [flat_page(worker, p) for p in (40, 41, 42)] == blobs
        a.detach()
        b.detach()


def test_byte_only_pools_cannot_move_pages_by_index_and_need_a_byte_size(daemon: Daemon) -> None:
    with HiCacheClient(daemon.target) as client:
        b = client.attach(WorkerIdentity("byte-only", 1, "m-bytes-2"), [spec(None)])
        before = b.stats().pools()  # its own group (a worker sees no other)
        with pytest.raises(HiCacheError) as info:
            b.write([Transfer("kv", [0, 1])], allocate=True)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "byte-only" in info.value.message
        assert b.stats().pools() == before  # nothing allocated
        b.detach()
        ratio_spec = spec(None)
        ratio_spec.host_size.ratio = 2.0  # the oneof now holds a ratio
        with pytest.raises(HiCacheError) as info:
            client.attach(WorkerIdentity("byte-ratio", 1, "m-bytes-3"), [ratio_spec])
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "host_size.bytes" in info.value.message
