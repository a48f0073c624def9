"""The KV pools an integration-test worker exports, and byte-exact page snapshots.

A worker's "device" pools are ``ShmKVPool`` segments (created and unlinked by
the worker that owns them). Two pools form the group: ``kv`` (anchor, MHA,
float16) and ``draft`` (sidecar: a speculative-decoding draft KV, bfloat16).
"""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from hicached_client import Transfer, pool_spec
from hicached_client.export import ShmKVPool
from hicached_client.v1 import types_pb2 as tpb

PAGE_SIZE = 4
DEVICE_PAGES = 1024
TOKENS = PAGE_SIZE * DEVICE_PAGES
KV_LAYERS, KV_HEADS, KV_DIM = 2, 2, 16
DRAFT_LAYERS, DRAFT_HEADS, DRAFT_DIM = 1, 1, 16
POOLS = ("draft", "kv")  # name order: the daemon processes transfers in this order


def unique_tag(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@dataclass
class WorkerPools:
    """The two device pools of one worker; ``close()`` unmaps and unlinks both segments."""

    kv: ShmKVPool
    draft: ShmKVPool

    @classmethod
    def create(cls, tag: str) -> WorkerPools:
        kv = ShmKVPool(
            f"hct-{tag}-kv",
            num_layers=KV_LAYERS,
            tokens=TOKENS,
            heads=KV_HEADS,
            head_dim=KV_DIM,
            dtype=torch.float16,
        )
        try:
            draft = ShmKVPool(
                f"hct-{tag}-draft",
                num_layers=DRAFT_LAYERS,
                tokens=TOKENS,
                heads=DRAFT_HEADS,
                head_dim=DRAFT_DIM,
                dtype=torch.bfloat16,
            )
        except BaseException:
            kv.close()
            kv.unlink()
            raise
        return cls(kv=kv, draft=draft)

    def by_name(self, name: str) -> ShmKVPool:
        return {"kv": self.kv, "draft": self.draft}[name]

    def specs(self, *, host_ratio: float = 1.0) -> list[tpb.PoolSpec]:
        return [
            pool_spec(
                "kv",
                role="anchor",
                kind="mha",
                dtype="float16",
                host_layout="layer_first",
                page_size=PAGE_SIZE,
                num_layers=KV_LAYERS,
                num_heads=KV_HEADS,
                head_dim=KV_DIM,
                k_buffers=self.kv.k_buffers(),
                v_buffers=self.kv.v_buffers(),
                host_ratio=host_ratio,
            ),
            pool_spec(
                "draft",
                role="sidecar",
                kind="mha",
                dtype="bfloat16",
                host_layout="page_first",
                page_size=PAGE_SIZE,
                num_layers=DRAFT_LAYERS,
                num_heads=DRAFT_HEADS,
                head_dim=DRAFT_DIM,
                k_buffers=self.draft.k_buffers(),
                v_buffers=self.draft.v_buffers(),
                host_ratio=host_ratio,
            ),
        ]

    def fill_random(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for pool in (self.kv, self.draft):
            for t in (*pool.k, *pool.v):
                bits = t.view(torch.int16)
                bits.copy_(torch.randint(-(1 << 15), 1 << 15, bits.shape, generator=gen, dtype=torch.int16))

    def clobber(self) -> None:
        for pool in (self.kv, self.draft):
            for t in (*pool.k, *pool.v):
                t.view(torch.int16).fill_(-1)

    def pages(self, name: str, pages: Sequence[int]) -> torch.Tensor:
        """Raw bytes of ``pages`` of pool ``name``: (len(pages), buffers, page_bytes_per_buffer)."""
        pool = self.by_name(name)
        idx = torch.tensor(list(pages), dtype=torch.int64)
        per_buffer = [
            t.view(torch.uint8).reshape(DEVICE_PAGES, -1).index_select(0, idx) for t in (*pool.k, *pool.v)
        ]
        return torch.stack(per_buffer, dim=1)

    def digest(self, name: str, pages: Sequence[int]) -> str:
        return hashlib.sha256(self.pages(name, pages).numpy().tobytes()).hexdigest()

    def untouched(self, name: str, excluding: Sequence[int]) -> bool:
        """True when every page outside ``excluding`` still holds the clobber pattern."""
        rest = sorted(set(range(DEVICE_PAGES)) - set(excluding))
        return bool((self.pages(name, rest) == 0xFF).all())

    def close(self) -> None:
        for pool in (self.kv, self.draft):
            pool.close()
            pool.unlink()


def transfers(device_pages: Sequence[int], host: dict[str, Sequence[int]] | None = None) -> list[Transfer]:
    """One transfer per pool with the same device pages (host pages per pool when given)."""
    return [Transfer(name, list(device_pages), None if host is None else list(host[name])) for name in POOLS]


def host_pages_of(result_transfers: Sequence[Transfer]) -> dict[str, list[int]]:
    return {t.pool: list(t.host_pages or ()) for t in result_transfers}
