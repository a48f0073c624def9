"""Real SGLang 0.5.23 host pools and storage backends, built on CPU for the tests.

Everything here goes through SGLang's own classes: the host pools are
``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` over small CPU "device"
buffers, and the storage is made by ``StorageBackendFactory.create_backend(
"dynamic", ...)`` exactly as SGLang's cache controller does, followed by
``register_mem_pool_host``.
"""

from __future__ import annotations

import hashlib
import uuid
from array import array
from dataclasses import dataclass, field
from typing import Any

import torch

import tests.sglang.env  # noqa: F401  (must precede the SGLang imports)

# isort: split
from sglang.srt.mem_cache.device_pool_info import (
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str

DTYPE = torch.bfloat16
LAYOUTS = ("layer_first", "page_first", "page_first_direct")


@dataclass(frozen=True)
class PoolShape:
    mla: bool = False
    layout: str = "layer_first"
    layers: int = 2
    heads: int = 2
    head_dim: int = 8
    page_size: int = 4
    device_tokens: int = 64
    ratio: float = 2.0
    v_head_dim: int | None = None  # MHA: V's width when it differs from K's


def _ptrs(bufs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)


def make_host_pool(shape: PoolShape, allocator_type: str = "default") -> Any:
    """A real SGLang host pool on CPU, filled with random bits."""
    tokens = shape.device_tokens + shape.page_size
    cpu = torch.device("cpu")
    common: dict[str, Any] = {
        "pin_memory": False,
        "device": "cpu",
        "allocator_type": allocator_type,
        "device_capacity_tokens": shape.device_tokens,
        "start_layer": 0,
        "end_layer": shape.layers,
    }
    if shape.mla:
        width = shape.head_dim * 3
        bufs = tuple(torch.zeros(tokens, 1, width, dtype=DTYPE) for _ in range(shape.layers))
        info = MLABufferInfo(
            buffers=bufs,
            data_ptrs=_ptrs(bufs),
            layer_indices=tuple(range(shape.layers)),
            device_layer_num=shape.layers,
            page_size=shape.page_size,
            kv_lora_rank=shape.head_dim * 2,
            qk_rope_head_dim=shape.head_dim,
            kv_cache_dim=width,
            dtype=DTYPE,
            device=cpu,
        )
        pool = MLATokenToKVPoolHost(
            info, shape.ratio, 0, shape.page_size, shape.layout, target_layer_num=shape.layers, **common
        )
    else:
        k = tuple(torch.zeros(tokens, shape.heads, shape.head_dim, dtype=DTYPE) for _ in range(shape.layers))
        v_dim = shape.v_head_dim or shape.head_dim
        v = tuple(torch.zeros(tokens, shape.heads, v_dim, dtype=DTYPE) for _ in range(shape.layers))
        mha = MHABufferInfo(
            buffers=KVBuffers(
                k=k, v=v, k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v), layout=KVBufferLayout.NHD
            ),
            page_size=shape.page_size,
            head_num=shape.heads,
            head_dim=shape.head_dim,
            v_head_dim=v_dim,
            dtype=DTYPE,
            device=cpu,
        )
        pool = MHATokenToKVPoolHost(mha, shape.ratio, 0, shape.page_size, shape.layout, **common)
    randomize(pool)
    return pool


def randomize(pool: Any, seed: int | None = None) -> None:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    bits = pool.kv_buffer.view(torch.int16)
    bits.copy_(torch.randint(-(2**15), 2**15, bits.shape, dtype=torch.int16, generator=gen))


def page_bits(pool: Any, host_indices: torch.Tensor) -> list[bytes]:
    """The flat data page bytes at each page-aligned run of ``host_indices``."""
    ps = pool.page_size
    return [
        pool.get_data_page(int(i), flat=True).contiguous().view(torch.uint8).numpy().tobytes()
        for i in host_indices[::ps]
    ]


def digest(pages: list[bytes]) -> str:
    h = hashlib.sha256()
    for p in pages:
        h.update(p)
    return h.hexdigest()


def sglang_keys(
    num_pages: int, page_size: int, *, cache_salt: str | None = None, first: int = 0
) -> list[str]:
    """Page keys as SGLang computes them for a token run (``get_storage_hash_str``)."""
    tokens = array("l", range(first, first + num_pages * page_size))
    keys = get_storage_hash_str(RadixKey(tokens, cache_salt=cache_salt), page_size=page_size)
    assert isinstance(keys, list)
    return keys


def unique_model(tag: str = "m") -> str:
    return f"org/{tag}-{uuid.uuid4().hex[:10]}"


@dataclass
class StorageFactory:
    """Makes storages through SGLang's factory against one daemon; closes them all at the end."""

    target: str
    made: list[HiCacheStorage] = field(default_factory=list)

    def config(
        self,
        *,
        model: str,
        mla: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        pp_rank: int = 0,
        pp_size: int = 1,
        layout: str = "layer_first",
        metrics: bool = False,
        **options: Any,
    ) -> HiCacheStorageConfig:
        return HiCacheStorageConfig(
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
            pp_size=pp_size,
            attn_cp_rank=0,
            attn_cp_size=1,
            is_mla_model=mla,
            enable_storage_metrics=metrics,
            is_page_first_layout=layout != "layer_first",
            model_name=model,
            extra_config=dynamic_extra_config(self.target, **options),
        )

    def make(self, host_pool: Any, **kwargs: Any) -> Any:
        cfg = self.config(mla=isinstance(host_pool, MLATokenToKVPoolHost), layout=host_pool.layout, **kwargs)
        storage = StorageBackendFactory.create_backend("dynamic", cfg, host_pool)
        self.made.append(storage)
        storage.register_mem_pool_host(host_pool)
        storage.on_host_pools_registered()
        return storage

    def close_all(self) -> None:
        for storage in self.made:
            storage.close()


def dynamic_extra_config(target: str, **options: Any) -> dict[str, Any]:
    """SGLang's ``--hicache-storage-backend-extra-config`` for this adapter."""
    options.setdefault("target", target)
    return {
        "backend_name": "hicached",
        "module_path": "hicached_client.sglang",
        "class_name": "HiCachedStorage",
        "interface_v1": 1,
        "hicached": options,
    }
