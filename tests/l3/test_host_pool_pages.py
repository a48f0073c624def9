"""Every backend moves real host-pool pages: set_from a pool's page chunks, get_into another's."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import torch

from hicached.l2 import HostKVPool, HostLayout, KVSpec, PoolKind, create_host_pool
from hicached.l3 import StorageBackend

SPEC = KVSpec(PoolKind.MHA, torch.float16, 3, 2, 8, 4)  # 3 layers, 2 heads, dim 8, 4 tokens/page


@pytest.fixture(params=list(HostLayout))
def pools(request: pytest.FixtureRequest) -> Iterator[tuple[HostKVPool, HostKVPool]]:
    made = []
    for side in ("src", "dst"):
        name = f"hicached-l3-test-{side}-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        made.append(create_host_pool(SPEC, request.param, 8, segment_name=name, pin=False))
    yield made[0], made[1]
    for pool in made:
        pool.close()
        pool.unlink()


def test_pool_pages_roundtrip(backend: StorageBackend, pools: tuple[HostKVPool, HostKVPool]) -> None:
    src, dst = pools
    generator = torch.Generator().manual_seed(1)
    for kv in range(SPEC.num_kv):
        for layer in range(SPEC.num_layers):
            view = src.kv_layer_pages(kv, layer)
            view.copy_(torch.randn(view.shape, generator=generator).to(view.dtype))
    src_pages, dst_pages = [1, 2, 5], [6, 0, 3]
    keys = [f"pool/{src.layout}/{p}" for p in src_pages]
    assert backend.set_from(keys, [src.page_chunks(p) for p in src_pages]) == [True] * 3
    assert backend.get_into(keys, [dst.page_chunks(p) for p in dst_pages]) == [True] * 3
    for s, d in zip(src_pages, dst_pages, strict=True):
        assert torch.equal(src.get_page_flat(s), dst.get_page_flat(d))
    untouched = dst.get_page_flat(7)
    assert not untouched.any()
