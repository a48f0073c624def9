"""Hugging Face transformers: a ``DynamicCache`` prefix saved to and restored from the daemon.

:class:`HFKVCache` gives a transformers worker (batch 1, full attention) a
"device" KV area in POSIX shared memory shaped like the model's KV
(``ShmKVPool``, a sealed memfd handed to the daemon at attach: per layer
``(slots, kv_heads, head_dim)`` K and V) and one
daemon session over it. Pages are ``page_size`` tokens; their keys are the
daemon's hash chain of the token ids (``TokenChain``), so any worker of the
same model and KV layout that saw the same tokens finds them:

* :meth:`save_prefix` copies the page-aligned prefix of a cache into the area
  and stores it (``PutPages``; keys already cached are skipped);
* :meth:`load_prefix` loads the longest cached page-aligned prefix of a prompt
  (``GetPages``, L2 and optionally L3) and builds a new ``DynamicCache`` from
  it, leaving at least one prompt token to compute;
* :meth:`retract` / :meth:`resume` back a request's whole KV up to the daemon's
  host memory (``RetractBackup``) and restore it into other slots
  (``RetractRestore``), e.g. to free the worker's memory under pressure.

``transformers`` itself is not imported here: caches are built through the
``cache_factory`` (default ``transformers.DynamicCache``) and read through
their ``layers[i].keys`` / ``.values`` tensors ``(1, kv_heads, seq, head_dim)``.

Thread-safety: one request at a time (the area's slots are reused by every
call); use one ``HFKVCache`` per thread. Ownership: the caller's caches are
only read by the save calls; the load calls return new caches owning their
tensors. :meth:`close` detaches the session and unmaps the area.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hicached_client.export import ShmKVPool
from hicached_client.specs import pool_spec
from hicached_client.sync import HiCacheClient, Session
from hicached_client.types import PoolRole, TokenChain, Transfer, WorkerIdentity

POOL = "kv"


@dataclass(frozen=True)
class KVShape:
    """The KV geometry of a decoder model (what a page of the daemon pool holds)."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, config: Any, dtype: torch.dtype = torch.float32) -> KVShape:
        """From a transformers config (``LlamaConfig`` and alike)."""
        heads = config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            dtype=dtype,
        )


@dataclass(frozen=True)
class Retracted:
    """A request's KV held by the daemon: pass to :meth:`HFKVCache.resume` (once)."""

    backup_id: str
    num_tokens: int


def _dynamic_cache() -> Any:
    from transformers import DynamicCache

    return DynamicCache()


class HFKVCache:
    """One worker's KV area and daemon session (see the module docstring)."""

    def __init__(
        self,
        client: HiCacheClient,
        *,
        model_name: str,
        shape: KVShape,
        page_size: int = 16,
        slots: int = 4096,
        host_bytes: int | None = None,
        instance_id: str | None = None,
        generation: int | None = None,
        cache_factory: Callable[[], Any] = _dynamic_cache,
    ) -> None:
        if slots % page_size:
            raise ValueError(f"slots={slots} must be a multiple of page_size={page_size}")
        self.shape = shape
        self.page_size = page_size
        self.num_pages = slots // page_size
        self._factory = cache_factory
        self.pool = ShmKVPool(
            f"hicached-hf-{os.getpid()}-{uuid.uuid4().hex[:10]}",
            num_layers=shape.num_layers,
            tokens=slots,
            heads=shape.kv_heads,
            head_dim=shape.head_dim,
            dtype=shape.dtype,
        )
        try:
            spec = pool_spec(
                POOL,
                role=PoolRole.ANCHOR,
                kind="mha",
                dtype=shape.dtype,
                page_size=page_size,
                num_layers=shape.num_layers,
                num_heads=shape.kv_heads,
                head_dim=shape.head_dim,
                k_buffers=self.pool.k_buffers(),
                v_buffers=self.pool.v_buffers(),
                host_layout="page_first",
                host_bytes=host_bytes,
            )
            identity = WorkerIdentity(
                instance_id=instance_id or f"hf-{os.getpid()}-{uuid.uuid4().hex[:8]}",
                generation=generation if generation is not None else 1,
                model_name=model_name,
            )
            self.session: Session = client.attach(identity, [spec])
        except BaseException:
            self.pool.close()
            raise

    # ----------------------------------------------------------------- staging

    def _stage(self, cache: Any, num_tokens: int, first_page: int) -> None:
        """Copy tokens ``[0, num_tokens)`` of ``cache`` into the area from page ``first_page``."""
        lo = first_page * self.page_size
        if lo + num_tokens > self.num_pages * self.page_size:
            raise ValueError(
                f"{num_tokens} tokens from page {first_page} exceed the area's {self.num_pages} pages"
            )
        for i, layer in enumerate(cache.layers[: self.shape.num_layers]):
            # (1, heads, seq, dim) -> (seq, heads, dim)
            self.pool.k[i][lo : lo + num_tokens].copy_(layer.keys[0, :, :num_tokens].transpose(0, 1))
            self.pool.v[i][lo : lo + num_tokens].copy_(layer.values[0, :, :num_tokens].transpose(0, 1))

    def _unstage(self, num_tokens: int, first_page: int) -> Any:
        """A new cache holding tokens ``[0, num_tokens)`` read from page ``first_page`` on."""
        lo = first_page * self.page_size
        cache = self._factory()
        for i in range(self.shape.num_layers):
            k = self.pool.k[i][lo : lo + num_tokens].transpose(0, 1).unsqueeze(0).clone()
            v = self.pool.v[i][lo : lo + num_tokens].transpose(0, 1).unsqueeze(0).clone()
            cache.update(k, v, i)
        return cache

    def _pages(self, count: int, first_page: int = 0) -> list[int]:
        if first_page + count > self.num_pages:
            raise ValueError(f"{count} pages from page {first_page} exceed the area's {self.num_pages} pages")
        return list(range(first_page, first_page + count))

    # ------------------------------------------------------------------ prefix

    def save_prefix(self, token_ids: Sequence[int], cache: Any) -> int:
        """Store the page-aligned prefix of ``cache`` (which holds ``token_ids``); pages stored or present.

        Returns 0 when the daemon refused for lack of room (nothing stored).
        """
        tokens = min(len(token_ids), cache.get_seq_length())
        pages = tokens // self.page_size
        if pages == 0:
            return 0
        self._stage(cache, pages * self.page_size, 0)
        chain = TokenChain(list(token_ids[: pages * self.page_size]))
        result = self.session.put_pages(chain, [Transfer(POOL, self._pages(pages))])
        return result.stored_pages + result.existing_pages if result.ok else 0

    def cached_tokens(self, token_ids: Sequence[int], *, include_l3: bool = True) -> int:
        """Tokens of the longest cached page-aligned prefix of ``token_ids`` (a lookup, no copy)."""
        pages = len(token_ids) // self.page_size
        if pages == 0:
            return 0
        found = self.session.lookup(TokenChain(list(token_ids[: pages * self.page_size])))
        return (found.total_hit_pages if include_l3 else found.l2_hit_pages) * self.page_size

    def load_prefix(self, token_ids: Sequence[int], *, include_l3: bool = True) -> tuple[Any, int]:
        """(new cache, tokens it holds) for the longest cached prefix of ``token_ids``.

        At most ``len(token_ids) - 1`` tokens are restored, so the model still
        has a token to compute logits from. ``(None, 0)`` on a miss.
        """
        pages = min((len(token_ids) - 1) // self.page_size, self.num_pages)
        if pages <= 0:
            return None, 0
        chain = TokenChain(list(token_ids[: pages * self.page_size]))
        got = self.session.get_pages(chain, [Transfer(POOL, self._pages(pages))], include_l3=include_l3)
        if got.hit_pages == 0:
            return None, 0
        tokens = got.hit_pages * self.page_size
        return self._unstage(tokens, 0), tokens

    def persist(self, token_ids: Sequence[int]) -> int:
        """Wait until the cached prefix of ``token_ids`` is in the daemon's L3; pages stored now."""
        pages = len(token_ids) // self.page_size
        if pages == 0:
            return 0
        return self.session.backup(
            TokenChain(list(token_ids[: pages * self.page_size])), wait=True
        ).stored_pages

    # -------------------------------------------------------------- retraction

    def retract(self, request_id: str, cache: Any, *, first_page: int = 0) -> Retracted | None:
        """Back up every token of ``cache`` (last partial page included); None when declined (no room)."""
        tokens = cache.get_seq_length()
        pages = -(-tokens // self.page_size)
        self._stage(cache, tokens, first_page)
        result = self.session.retract_backup(
            request_id, [Transfer(POOL, self._pages(pages, first_page))], num_tokens=tokens
        )
        return Retracted(result.backup_id, tokens) if result.ok else None

    def resume(self, retracted: Retracted, *, first_page: int = 0) -> Any:
        """Restore a retracted request into the pages from ``first_page``; a new cache."""
        pages = -(-retracted.num_tokens // self.page_size)
        self.session.retract_restore_wait(
            retracted.backup_id, [Transfer(POOL, self._pages(pages, first_page))], layer_progress=False
        )
        return self._unstage(retracted.num_tokens, first_page)

    def close(self) -> None:
        """Detach the session and unmap the area (idempotent)."""
        self.session.close()
        self.pool.close()

    def __enter__(self) -> HFKVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
