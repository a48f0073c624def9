"""How ``HiCachedStorage`` names its daemon sessions and key spaces, one per SGLang pool.

Pure construction: from SGLang's ``HiCacheStorageConfig`` and the adapter's
options to a :class:`PoolLink` (a registered host pool) or the byte-path
:class:`BlobStore`. Key spaces follow SGLang's ``HiCacheFile``: model, TP/PP
rank, tenant and pool separate pages (see :mod:`hicached_client.sglang.namespace`).
Thread-safety: the functions keep no state; the objects they return are
thread-safe.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from hicached_client.sglang.blobs import BLOB_POOL, BlobStore
from hicached_client.sglang.config import AdapterConfig
from hicached_client.sglang.layouts import bind_host_pool
from hicached_client.sglang.link import PoolLink
from hicached_client.sglang.namespace import KV_POOL, key_space
from hicached_client.sglang.refusals import RefusalLog
from hicached_client.sync import HiCacheClient
from hicached_client.types import WorkerIdentity

__all__ = ["new_blob_store", "new_pool_link"]


def new_pool_link(
    client: HiCacheClient,
    cfg: Any,
    config: AdapterConfig,
    *,
    name: str,
    host_pool: Any,
    generation: int,
    refusals: RefusalLog,
) -> PoolLink:
    """A daemon session for SGLang pool ``name`` over ``host_pool`` (``cfg``: SGLang's storage config)."""
    binding = bind_host_pool(host_pool)
    # The daemon separates TP ranks for MHA groups by itself; pools it sees as
    # rank-shared (MLA kind) carry the rank in the key unless SGLang shares them.
    daemon_shares_tp = binding.geometry.kind.value == "mla"
    sglang_shares_tp = bool(cfg.is_mla_model) and name != "mamba"
    keys = key_space(
        name,
        tenant=config.tenant,
        tp_rank=cfg.tp_rank,
        tp_size=cfg.tp_size,
        tp_sharded_in_key=daemon_shares_tp and not sglang_shares_tp,
        attn_cp_rank=cfg.attn_cp_rank,
        attn_cp_size=cfg.attn_cp_size,
        dcp_rank=getattr(cfg, "dcp_rank", 0),
        dcp_size=getattr(cfg, "dcp_size", 1),
        logical_page_size=getattr(cfg, "logical_page_size", None),
    )
    identity = WorkerIdentity(
        instance_id=config.instance_id if name == KV_POOL else f"{config.instance_id}.{name}",
        generation=generation,
        model_name=cfg.model_name or "",
        tp_rank=cfg.tp_rank,
        tp_size=cfg.tp_size,
        pp_rank=cfg.pp_rank,
        pp_size=cfg.pp_size,
        tenant=config.tenant,
    )
    segment = f"hicached-sgl-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    return PoolLink(
        client,
        config=config,
        identity=identity,
        binding=binding,
        keys=keys,
        segment_name=segment,
        refusals=refusals,
    )


def new_blob_store(
    client: HiCacheClient, cfg: Any, config: AdapterConfig, *, generation: int, refusals: RefusalLog
) -> BlobStore:
    """The byte-path store of tensors by key (attached on first use)."""
    keys = key_space(
        BLOB_POOL,
        tenant=config.tenant,
        tp_rank=cfg.tp_rank,
        tp_size=cfg.tp_size,
        # The byte-path group is rank-shared; MLA models share by-key tensors
        # across TP ranks as HiCacheFile's config_suffix does, others do not.
        tp_sharded_in_key=not cfg.is_mla_model,
        attn_cp_rank=cfg.attn_cp_rank,
        attn_cp_size=cfg.attn_cp_size,
        dcp_rank=getattr(cfg, "dcp_rank", 0),
        dcp_size=getattr(cfg, "dcp_size", 1),
        logical_page_size=getattr(cfg, "logical_page_size", None),
    )
    identity = WorkerIdentity(
        instance_id=f"{config.instance_id}.{BLOB_POOL}",
        generation=generation,
        model_name=cfg.model_name or "",
        pp_rank=cfg.pp_rank,
        pp_size=cfg.pp_size,
        tenant=config.tenant,  # its calls name the tenant: the session must be of it
    )
    return BlobStore(client, config=config, identity=identity, keys=keys, refusals=refusals)
