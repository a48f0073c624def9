"""Hugging Face transformers: a ``DynamicCache`` prefix saved to and restored from the daemon.

:class:`HFKVCache` gives a transformers worker (batch 1, full attention) a
"device" KV area in POSIX shared memory shaped like the model's KV
(``ShmKVPool``, a sealed memfd handed to the daemon at attach: per layer
``(slots, kv_heads, head_dim)`` K and V) and one
daemon session over it. Pages are ``page_size`` tokens; their keys are the
daemon's hash chain of the token ids (``TokenChain``), so any worker of the
same model and KV layout that saw the same tokens finds them. ``model_name``
must name the weights (checkpoint and revision: a fine-tune is another model);
a :class:`KVShape` made by :meth:`KVShape.of` also carries a digest of the
model's config, in every key, so models whose configs differ (rope, attention
heads, hidden size...) never restore each other's pages:

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

Caches are checked against the session's :class:`KVShape` before anything is
copied (a ``ValueError`` names the mismatch; nothing is staged or sent): as many
layers as the shape, batch 1, the shape's kv heads, head_dim and dtype, and
every token of the prefix held (sliding-window layers are refused: they keep
only the last tokens). ``token_ids`` are one sequence: a list, a 1-D tensor or
array, or a ``(1, seq)`` one as tokenizers return ``input_ids`` (squeezed);
anything else is a ``ValueError``. The area holds ``slots`` tokens: longer
prompts are saved, looked up and loaded up to the area's size.

Thread-safety: one request at a time (the area's slots are reused by every
call); use one ``HFKVCache`` per thread. Ownership: the caller's caches are
only read by the save calls; the load calls return new caches owning their
tensors, on ``device`` (CPU by default). :meth:`close` detaches the session and
always unmaps the area (even when the Detach fails; a later ``close()`` retries
the Detach); any other call after it is a ``ValueError``.

A session the daemon no longer knows (it restarted, or the lease ran out) is
attached again once, with the same identity and area, and the call re-sent; a
daemon that is down raises its ``UNAVAILABLE`` ``HiCacheError``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np
import torch

from hicached_client.errors import HiCacheError
from hicached_client.export import ShmKVPool
from hicached_client.specs import pool_spec
from hicached_client.sync import HiCacheClient, Session
from hicached_client.types import PoolRole, TokenChain, Transfer, WorkerIdentity

POOL = "kv"
T = TypeVar("T")
log = logging.getLogger(__name__)
# Config entries that say how a model is loaded, run or labelled, not what its KV is: left
# out of the digest, so workers loading one model differently still share its pages
# (save_pretrained fills in architectures; pipelines set pad_token_id). The version of
# transformers is left out too, but its spelling of an entry is not (v5's rope_parameters
# for v4's rope_theta): workers on two major versions do not share.
_NOT_THE_MODEL = frozenset(
    {
        "_name_or_path",
        "_commit_hash",
        "transformers_version",
        "dtype",  # the shape's own field
        "torch_dtype",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "attn_implementation",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "torchscript",
        "architectures",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "id2label",
        "label2id",
        "problem_type",
        "tokenizer_class",
        "initializer_range",
        "chunk_size_feed_forward",
        "tie_word_embeddings",
    }
)


def config_digest(config: Any) -> str:
    """A digest of what a transformers config says about the model's computation (everything
    but the loading, run-time and labelling entries of :data:`_NOT_THE_MODEL`): two workers
    whose configs differ in any of it never share pages. Weights are not in it: ``model_name``
    names them."""
    to_dict = getattr(config, "to_dict", None)
    entries = to_dict() if callable(to_dict) else dict(vars(config))
    return hashlib.sha256(json.dumps(_kept(entries), sort_keys=True, default=str).encode()).hexdigest()[:32]


def _kept(entries: dict[str, Any]) -> dict[str, Any]:
    """``entries`` less :data:`_NOT_THE_MODEL`, in nested configs too (a text_config's)."""
    return {k: _kept(v) if isinstance(v, dict) else v for k, v in entries.items() if k not in _NOT_THE_MODEL}


@dataclass(frozen=True)
class KVShape:
    """The KV geometry of a decoder model (what a page of the daemon pool holds)."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    # :func:`config_digest` of the model's config (set by :meth:`of`); part of every page key.
    config_digest: str = ""

    @classmethod
    def of(cls, config: Any, dtype: torch.dtype | str | None = None) -> KVShape:
        """From a transformers config (``LlamaConfig`` and alike), in the model's dtype.

        ``dtype`` defaults to the config's (``config.dtype``, older transformers'
        ``config.torch_dtype``), which ``from_pretrained`` sets; a config built in code
        often has none, so pass the model's (``KVShape.of(model.config, model.dtype)``).
        A cache of another dtype is refused rather than silently converted.
        """
        if dtype is None:
            # ``torch_dtype`` only where ``dtype`` is absent: transformers 5 warns on reading it.
            name = "dtype" if hasattr(config, "dtype") else "torch_dtype"
            dtype = getattr(config, name, None)
        if dtype is None:
            raise ValueError(
                "dtype: the config names no dtype; pass the model's (KVShape.of(model.config, model.dtype))"
            )
        given = dtype
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(
                f"dtype: not a torch dtype: {str(given)[:40]!r} (e.g. torch.bfloat16 or 'bfloat16')"
            )
        heads = config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            dtype=dtype,
            config_digest=config_digest(config),
        )


@dataclass(frozen=True)
class Retracted:
    """A request's KV held by the daemon: pass to :meth:`HFKVCache.resume` (once)."""

    backup_id: str
    num_tokens: int


def _token_ids(token_ids: Any) -> list[int]:
    """One sequence's ids as a list: a ``(1, seq)`` tensor/array/nested list is squeezed."""
    if isinstance(token_ids, (str, bytes)):
        raise ValueError(f"token_ids must be integer ids, got {type(token_ids).__name__}")
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.detach().cpu().numpy()
    ids = np.asarray(token_ids)
    if ids.ndim == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.ndim != 1:
        raise ValueError(f"token_ids must be 1-D ids of one sequence, got shape {tuple(ids.shape)}")
    ints = ids.dtype.kind in "iu" or (ids.dtype.kind == "O" and all(type(t) is int for t in ids))
    if ids.size and not ints:
        raise ValueError(f"token_ids must be integers, got dtype {ids.dtype}")
    out = [int(t) for t in ids]
    if out and not (min(out) >= 0 and max(out) < 2**64):
        bad = next(t for t in out if not 0 <= t < 2**64)
        raise ValueError(f"token_ids must lie in [0, 2**64), got {str(bad)[:40]}")
    return out


def _held(cache: Any) -> int:
    """Tokens ``cache`` holds (a ValueError for what is no ``DynamicCache``)."""
    if getattr(cache, "layers", None) is None or not callable(getattr(cache, "get_seq_length", None)):
        raise ValueError(f"cache: expected a transformers DynamicCache, got {type(cache).__name__}")
    return int(cache.get_seq_length())


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
        tenant: str = "",
        cache_factory: Callable[[], Any] = _dynamic_cache,
        device: torch.device | str = "cpu",
    ) -> None:
        """``tenant`` separates workers of one model: pages of different tenants never hit each
        other. ``device``: where the caches :meth:`load_prefix` and :meth:`resume` build live."""
        if page_size <= 0 or slots <= 0 or slots % page_size:
            raise ValueError(f"slots={slots} must be a positive multiple of page_size={page_size} (> 0)")
        self.shape = shape
        self.page_size = page_size
        self.num_pages = slots // page_size
        self.device = torch.device(device)
        self._factory = cache_factory
        self._closed = False
        self._client = client
        self.pool = ShmKVPool(
            f"hicached-hf-{os.getpid()}-{uuid.uuid4().hex[:10]}",
            num_layers=shape.num_layers,
            tokens=slots,
            heads=shape.kv_heads,
            head_dim=shape.head_dim,
            dtype=shape.dtype,
        )
        try:
            self._spec = pool_spec(
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
            self._identity = WorkerIdentity(
                instance_id=instance_id or f"hf-{os.getpid()}-{uuid.uuid4().hex[:8]}",
                generation=generation if generation is not None else 1,
                model_name=model_name,
                tenant=tenant,
            )
            self.session: Session = client.attach(self._identity, [self._spec])
        except BaseException:
            self.pool.close()
            raise

    def _call(self, op: Callable[[Session], T], *, held: str = "") -> T:
        """``op(session)``; once more on a new session if the daemon no longer knows this one.

        NOT_FOUND is also some calls' own answer (an unknown retraction backup): the session
        is attached again only when a heartbeat confirms the daemon lost it. ``held``: what
        the call names that the lost session held (its NOT_FOUND then says so).
        """
        self._open()
        lost = self.session
        try:
            return op(lost)
        except HiCacheError as exc:
            if exc.code != grpc.StatusCode.NOT_FOUND or self._knows(lost):
                raise
            log.warning("hicached: the daemon lost session %s (%s); attaching again", lost.session_id, exc)
        lost.stop_heartbeat()
        self.session = self._client.attach(self._identity, [self._spec])
        try:
            return op(self.session)
        except HiCacheError as exc:
            if exc.code != grpc.StatusCode.NOT_FOUND or not held:
                raise
            raise HiCacheError(
                exc.code,
                f"{exc.message} (the daemon had lost this worker's session {lost.session_id[:8]}..., "
                f"and the {held} it held with it)",
                retry_after_ms=exc.retry_after_ms,
                method=exc.method,
            ) from None

    @staticmethod
    def _knows(session: Session) -> bool:
        try:
            session.heartbeat()
        except HiCacheError as exc:
            return exc.code != grpc.StatusCode.NOT_FOUND
        return True

    def _chain(self, ids: list[int], pages: int) -> TokenChain:
        """The page keys of the first ``pages`` pages of ``ids``, salted with the config's digest."""
        return TokenChain(ids[: pages * self.page_size], extra_key=self.shape.config_digest or None)

    # ----------------------------------------------------------------- staging

    def _open(self) -> None:
        if self._closed:
            raise ValueError("HFKVCache is closed")

    def _check(self, cache: Any, num_tokens: int) -> None:
        """ValueError unless ``cache`` holds ``num_tokens`` tokens of exactly the session's geometry.

        Without it a copy would broadcast a head, keep one row of a batch, convert the dtype or
        leave a missing layer's stale data in the area, and store that under the prompt's keys,
        which every worker of the model trusts.
        """
        shape = self.shape
        layers = getattr(cache, "layers", None)
        if layers is None:
            raise ValueError(f"cache: expected a transformers DynamicCache, got {type(cache).__name__}")
        if len(layers) != shape.num_layers:
            raise ValueError(f"cache has {len(layers)} layers, the session {shape.num_layers}")
        for i, layer in enumerate(layers):
            if getattr(layer, "is_sliding", False):
                raise ValueError(
                    f"layer {i} is a sliding-window layer: HFKVCache takes full-attention caches"
                )
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                if not isinstance(t, torch.Tensor) or t.ndim != 4:
                    raise ValueError(f"layer {i} {name}: expected a (1, kv_heads, seq, head_dim) tensor")
                batch, heads, held, dim = t.shape
                if batch != 1:
                    raise ValueError(f"layer {i} {name}: batch {batch}: HFKVCache takes batch-1 caches")
                if (heads, dim) != (shape.kv_heads, shape.head_dim):
                    raise ValueError(
                        f"layer {i} {name}: {heads} kv heads of head_dim {dim}, the session "
                        f"{shape.kv_heads} of {shape.head_dim}"
                    )
                if t.dtype != shape.dtype:
                    raise ValueError(f"layer {i} {name}: dtype {t.dtype} != session {shape.dtype}")
                if held < num_tokens:
                    raise ValueError(
                        f"layer {i} holds {held} tokens, {num_tokens} needed: every layer must hold "
                        "the whole prefix (a truncated or sliding-window layer cannot be saved)"
                    )

    def _stage(self, cache: Any, num_tokens: int, first_page: int) -> None:
        """Copy tokens ``[0, num_tokens)`` of ``cache`` into the area from page ``first_page``.

        Every check comes before the first copy, so a refused cache leaves the area untouched.
        """
        lo = first_page * self.page_size
        if lo + num_tokens > self.num_pages * self.page_size:
            raise ValueError(
                f"{num_tokens} tokens from page {first_page} exceed the area's {self.num_pages} pages "
                f"of {self.page_size} tokens (a larger slots= holds more)"
            )
        self._check(cache, num_tokens)
        for i, layer in enumerate(cache.layers[: self.shape.num_layers]):
            # (1, heads, seq, dim) -> (seq, heads, dim)
            self.pool.k[i][lo : lo + num_tokens].copy_(layer.keys[0, :, :num_tokens].transpose(0, 1))
            self.pool.v[i][lo : lo + num_tokens].copy_(layer.values[0, :, :num_tokens].transpose(0, 1))

    def _unstage(self, num_tokens: int, first_page: int) -> Any:
        """A new cache holding tokens ``[0, num_tokens)`` read from page ``first_page`` on."""
        lo = first_page * self.page_size
        cache = self._factory()
        for i in range(self.shape.num_layers):
            k = self.pool.k[i][lo : lo + num_tokens].transpose(0, 1).unsqueeze(0).to(self.device, copy=True)
            v = self.pool.v[i][lo : lo + num_tokens].transpose(0, 1).unsqueeze(0).to(self.device, copy=True)
            cache.update(k, v, i)
        return cache

    def _pages(self, count: int, first_page: int = 0) -> list[int]:
        if first_page + count > self.num_pages:
            raise ValueError(
                f"{count} pages from page {first_page} exceed the area's {self.num_pages} pages "
                "(a larger slots= holds more)"
            )
        return list(range(first_page, first_page + count))

    # ------------------------------------------------------------------ prefix

    def save_prefix(self, token_ids: Sequence[int] | Any, cache: Any) -> int:
        """Store the page-aligned prefix of ``cache`` (which holds ``token_ids``); pages stored or present.

        At most the area's ``slots`` tokens (the prefix of a longer prompt). Returns 0 when
        the daemon refused for lack of room (nothing stored).
        """
        self._open()
        ids = _token_ids(token_ids)
        pages = min(min(len(ids), _held(cache)) // self.page_size, self.num_pages)
        if pages == 0:
            return 0
        self._stage(cache, pages * self.page_size, 0)
        chain, to = self._chain(ids, pages), [Transfer(POOL, self._pages(pages))]
        result = self._call(lambda session: session.put_pages(chain, to))
        return result.stored_pages + result.existing_pages if result.ok else 0

    def cached_tokens(self, token_ids: Sequence[int] | Any, *, include_l3: bool = True) -> int:
        """Tokens of the longest cached page-aligned prefix of ``token_ids`` (a lookup, no copy),
        at most the area's ``slots`` (what :meth:`save_prefix` stores). A whole cached prompt
        counts here; :meth:`load_prefix` restores a page less of it (a token left to compute)."""
        self._open()
        ids = _token_ids(token_ids)
        pages = min(len(ids) // self.page_size, self.num_pages)
        if pages == 0:
            return 0
        chain = self._chain(ids, pages)
        found = self._call(lambda session: session.lookup(chain))
        # At most the pages asked about, whatever the daemon answers.
        return min(found.total_hit_pages if include_l3 else found.l2_hit_pages, pages) * self.page_size

    def load_prefix(self, token_ids: Sequence[int] | Any, *, include_l3: bool = True) -> tuple[Any, int]:
        """(new cache, tokens it holds) for the longest cached prefix of ``token_ids``.

        At most ``len(token_ids) - 1`` tokens (so the model still has a token to compute
        logits from) and at most the area's ``slots`` are restored. ``(None, 0)`` on a miss.
        """
        self._open()
        ids = _token_ids(token_ids)
        pages = min((len(ids) - 1) // self.page_size, self.num_pages)
        if pages <= 0:
            return None, 0
        chain, to = self._chain(ids, pages), [Transfer(POOL, self._pages(pages))]
        got = self._call(lambda session: session.get_pages(chain, to, include_l3=include_l3))
        hits = min(got.hit_pages, pages)  # a daemon's larger count would restore unloaded slots
        if hits == 0:
            return None, 0
        tokens = hits * self.page_size
        return self._unstage(tokens, 0), tokens

    def persist(self, token_ids: Sequence[int] | Any) -> int:
        """Wait until the cached prefix of ``token_ids`` (at most ``slots`` tokens) is in the
        daemon's L3; pages stored now."""
        self._open()
        ids = _token_ids(token_ids)
        pages = min(len(ids) // self.page_size, self.num_pages)
        if pages == 0:
            return 0
        chain = self._chain(ids, pages)
        return self._call(lambda session: session.backup(chain, wait=True)).stored_pages

    # -------------------------------------------------------------- retraction

    def retract(self, request_id: str, cache: Any, *, first_page: int = 0) -> Retracted | None:
        """Back up every token of ``cache`` (last partial page included); None when declined (no room)."""
        self._open()
        tokens = _held(cache)
        pages = -(-tokens // self.page_size)
        self._stage(cache, tokens, first_page)
        to = [Transfer(POOL, self._pages(pages, first_page))]
        result = self._call(lambda session: session.retract_backup(request_id, to, num_tokens=tokens))
        return Retracted(result.backup_id, tokens) if result.ok else None

    def resume(self, retracted: Retracted, *, first_page: int = 0) -> Any:
        """Restore a retracted request into the pages from ``first_page``; a new cache."""
        self._open()
        pages = -(-retracted.num_tokens // self.page_size)
        to = [Transfer(POOL, self._pages(pages, first_page))]
        self._call(
            lambda session: session.retract_restore_wait(retracted.backup_id, to, layer_progress=False),
            held="retraction backup: retract again",
        )
        return self._unstage(retracted.num_tokens, first_page)

    def close(self) -> None:
        """Detach the session and unmap the area (idempotent; not thread-safe).

        The area is unmapped even when the Detach fails (its error is raised afterwards);
        calling ``close()`` again then retries the Detach.
        """
        self._closed = True
        try:
            self.session.close()
        finally:
            self.pool.close()  # idempotent: the area is freed exactly once

    def __enter__(self) -> HFKVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
