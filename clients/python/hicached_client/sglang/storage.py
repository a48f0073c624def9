"""``HiCachedStorage``: SGLang's ``HiCacheStorage`` interface on top of the hicached daemon.

SGLang (0.5.23) loads it with its ``dynamic`` storage backend, which calls
``HiCachedStorage(storage_config, kwargs)``; see ``docs/sglang.md`` for the
launch flags. Each host pool SGLang registers (``register_mem_pool_host`` for
the KV pool, ``register_mem_host_pool_v2`` for side pools) becomes one daemon
session whose "device" pool is a shared-memory staging area: a write copies
the pages out of SGLang's host pool into it (one index op per batch) and asks
the daemon to store them (``PutPages``); a read asks the daemon to load the
leading run of hits into it (``GetPages``) and copies them into the host pool
(after a miss, one per-key ``Lookup`` finds the cached keys after it, which
are loaded too, as ``HiCacheFile`` reads every key).
Page bytes never travel in gRPC messages unless ``transport`` is ``bytes``.

Semantics kept from SGLang's backends (``HiCacheFile`` is the reference, see
``tests/sglang/test_sglang_hicachefile_parity.py``): a second set of an existing key
succeeds without rewriting; a missing key reads as a miss, never an error; a daemon
failure is logged and reads as a miss / failed write, a daemon down ending the call
(SGLang's threads must not die on it: :mod:`hicached_client.sglang.answers`).
Keys are namespaced by model, TP/PP rank, tenant and pool (see
:mod:`hicached_client.sglang.namespace`).

The generic ``get``/``set``/``exists`` take any tensor, as ``HiCacheFile``
does: a tensor the size of a registered KV pool's page goes through that pool;
any other tensor, and every tensor before a pool is registered, goes through
the byte path (:mod:`hicached_client.sglang.blobs`). A v1/v2 call naming a pool
that is not registered is logged and answers misses / failed writes. A write
the daemon refuses (no room, over budget) is ``False`` to SGLang and logged,
rate-limited, with the daemon's reason (:mod:`hicached_client.sglang.refusals`).

Thread-safety: SGLang calls the I/O methods from its prefetch and backup
threads concurrently; every method is safe for that. Pool registration and
``close`` happen on the scheduler thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
import torch
from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-untyped]
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolTransfer,
    PoolTransferResult,
)

from hicached_client.errors import HiCacheError
from hicached_client.sglang.answers import GIVE_UP, Unsupported, answers, no_pages, no_tensors, no_transfers
from hicached_client.sglang.config import AdapterConfig
from hicached_client.sglang.factory import new_blob_store, new_pool_link
from hicached_client.sglang.iostats import IoCounters
from hicached_client.sglang.link import PoolLink, once_each
from hicached_client.sglang.namespace import KV_POOL, KeySpace
from hicached_client.sglang.refusals import RefusalLog
from hicached_client.sync import HiCacheClient

log = logging.getLogger(__name__)
T = TypeVar("T")


class HiCachedStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang L3 storage backend served by a hicached daemon (see the module docstring).

    ``storage_config`` is SGLang's ``HiCacheStorageConfig``; its
    ``extra_config["hicached"]`` object holds :class:`AdapterConfig`'s options.
    ``kwargs`` is the (unused) dict SGLang's dynamic factory passes.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.config = AdapterConfig.from_extra_config(storage_config.extra_config)
        self.model_name: str = storage_config.model_name or ""
        cfg = self.config
        self._client = HiCacheClient(
            cfg.target, token=cfg.token, timeout_s=cfg.timeout_s, fast_lane=cfg.fast_lane
        )
        self._links: dict[str, PoolLink] = {}
        self._pools_by_id: dict[int, str] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._metrics_enabled = bool(storage_config.enable_storage_metrics)
        self._io = IoCounters()
        self._generation = time.time_ns()
        self.refusals = RefusalLog(log)
        self.failures = RefusalLog(log, template="hicached: %d keys of %s answered as misses: %s%s")
        self.unstored = RefusalLog(log, template="hicached: %d pages of %s not stored: %s%s")
        self._failed_calls = RefusalLog(log, template="hicached: %d %s failed, read as a miss: %s%s")
        self._unregistered = RefusalLog(log, template="hicached: %d keys for pool %s: %s%s")
        self._blobs = new_blob_store(
            self._client, storage_config, self.config, generation=self._generation, refusals=self.refusals
        )
        log.info(
            "hicached storage for model %r rank tp%d/%d pp%d/%d at %s",
            self.model_name,
            storage_config.tp_rank,
            storage_config.tp_size,
            storage_config.pp_rank,
            storage_config.pp_size,
            self.config.target,
        )

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------ registration

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Attach SGLang's KV host pool (the anchor of v1 and of the ``kv`` pool of v2)."""
        super().register_mem_pool_host(mem_pool_host)
        self._attach(KV_POOL, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Attach a side pool (``PoolName``); the KV pool registered again reuses its link."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._attach(str(host_pool_name), host_pool)

    def _attach(self, name: str, host_pool: Any) -> PoolLink:
        with self._lock:
            if self._closed:
                raise ValueError("HiCachedStorage is closed")
            link = self._links.get(name)
            if link is not None:
                if link.binding.host_pool is not host_pool:
                    raise ValueError(f"pool {name!r} is already registered with another host pool")
                return link
            known = self._pools_by_id.get(id(host_pool))
            if known is not None:
                # The same host pool under a second name (the KV pool through v2).
                self._links[name] = self._links[known]
                return self._links[known]
            link = self._new_link(name, host_pool)
            self._links[name] = link
            self._pools_by_id[id(host_pool)] = name
            return link

    def _new_link(self, name: str, host_pool: Any) -> PoolLink:
        return new_pool_link(
            self._client,
            self.storage_config,
            self.config,
            name=name,
            host_pool=host_pool,
            generation=self._generation,
            refusals=self.refusals,
        )

    def _link(self, name: str) -> PoolLink | None:
        """The link of pool ``name``; None (logged, rate-limited) when it is not registered."""
        link = self._links.get(name)
        if link is None:
            self._unregistered.refused(
                name, 0, f"not registered (registered: {sorted(self._links)}); answered as misses"
            )
        return link

    @property
    def links(self) -> dict[str, PoolLink]:
        """The attached pools by SGLang pool name (read-only view for tests and tools)."""
        return dict(self._links)

    # ----------------------------------------------------------- v1 zero-copy

    @answers(no_pages)
    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Store the pages at ``host_indices`` (token slots, page-aligned) under ``keys``."""
        return self._set_pages(KV_POOL, keys, host_indices)

    @answers(no_pages)
    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Load every cached one of ``keys`` into ``host_indices``; True per loaded page."""
        return self._get_pages(KV_POOL, keys, host_indices)

    def _set_pages(self, pool: str, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        if not keys:
            return []
        link = self._link(pool)
        if link is None:
            return [False] * len(keys)
        pages = link.binding.host_pages_of(host_indices, len(keys))
        start = time.perf_counter()
        try:
            results = once_each(link.keys.daemon_keys(keys), pages, link.put_pages)
        except HiCacheError as exc:
            self._not_stored(pool, len(keys), exc)
            return [False] * len(keys)
        self._record("backup", sum(results), link, start)
        return results

    def _not_stored(self, pool: str, pages: int, exc: HiCacheError) -> None:
        """A write that raised, logged rate-limited (a daemon that is down fails every call): a
        refusal over a limit (RESOURCE_EXHAUSTED) with the refusals, anything else apart."""
        log_as = self.refusals if exc.code is grpc.StatusCode.RESOURCE_EXHAUSTED else self.unstored
        log_as.refused(pool, pages, str(exc))

    def _get_pages(self, pool: str, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        if not keys:
            return []
        link = self._link(pool)
        if link is None:
            return [False] * len(keys)
        pages = link.binding.host_pages_of(host_indices, len(keys))
        daemon_keys = link.keys.daemon_keys(keys)
        start = time.perf_counter()
        try:
            loaded = link.load_each(
                daemon_keys, lambda lo, hi: link.get_pages(daemon_keys[lo:hi], pages[lo:hi])
            )
        except HiCacheError as exc:
            self.failures.refused(f"pool {pool}", len(keys), str(exc))
            return [False] * len(keys)
        self._record("prefetch", sum(loaded), link, start)
        return loaded

    def _record(self, kind: str, pages: int, link: PoolLink, start: float) -> None:
        if self._metrics_enabled and pages:
            self._io.record(kind, pages, link.binding.geometry.page_bytes, time.perf_counter() - start)

    # ------------------------------------------------------------------- v2

    @answers(lambda *_, **__: PoolTransferResult(0, {}, []))
    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """Usable prefix over the KV pool and every side pool's hit policy (as ``HiCacheFile``)."""
        kv_pages = self.batch_exists(keys, extra_info)
        hit_count: dict[str, int] = {KV_POOL: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            name = str(transfer.name)
            link = self._links.get(name)
            if transfer.hit_policy not in (PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES):
                raise Unsupported(f"unsupported pool hit policy {transfer.hit_policy!r} for pool {name!r}")
            if link is None:
                # Nothing of an unregistered pool can be restored.
                self._link(name)
                restorable = []
                break
            prefix = link.keys.daemon_keys(keys[:kv_pages])
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = self._safe(lambda: link.exists(prefix), 0)  # noqa: B023 - called at once
                pool_restorable = set(range(1, boundary + 1))
            elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                present = self._safe(lambda: link.membership(prefix), [False] * kv_pages)  # noqa: B023
                trailing = max(1, len(transfer.keys) if transfer.keys else 1)
                pool_restorable = {
                    n for n in range(1, kv_pages + 1) if all(present[max(0, n - trailing) : n])
                }
                boundary = max(pool_restorable, default=0)
            else:
                raise Unsupported(f"unsupported pool hit policy {transfer.hit_policy!r} for pool {name!r}")
            if boundary:
                hit_count[name] = boundary
            restorable = [p for p in restorable if p in pool_restorable]
        final_pages = restorable[-1] if restorable else 0
        return PoolTransferResult(final_pages, hit_count, restorable)

    @answers(no_transfers)
    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Load each transfer's cached keys into its pool's host indices (every one, as HiCacheFile)."""
        return self._v2(transfers, self._get_pages)

    @answers(no_transfers)
    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Store each transfer's host pages under its keys, each pool under its own key space."""
        return self._v2(transfers, self._set_pages)

    def _v2(self, transfers: Sequence[PoolTransfer], op: Any) -> dict[str, list[bool]]:
        results: dict[str, list[bool]] = {}
        for transfer in transfers:
            name = str(transfer.name)
            keys = list(transfer.keys or [])
            link = self._link(name)
            if link is None:
                results[name] = [False] * len(keys)
                continue
            want = len(keys) * link.binding.geometry.page_size
            got = transfer.host_indices.numel() if transfer.host_indices is not None else 0
            if got != want:
                log.error(
                    "hicached: pool %s: %d host indices for %d keys (want %d)", name, got, len(keys), want
                )
                results[name] = [False] * len(keys)
                continue
            results[name] = op(name, keys, transfer.host_indices)
        return results

    # ------------------------------------------------- generic page interface

    def _fits(self, tensor: torch.Tensor | None) -> PoolLink | None:
        """The KV pool link when ``tensor`` (None: any) is exactly one of its flat pages."""
        link = self._links.get(KV_POOL)
        if link is None or tensor is None:
            return link
        nbytes = tensor.numel() * tensor.element_size()
        return link if nbytes == link.binding.geometry.page_bytes and tensor.is_contiguous() else None

    @answers(lambda *_, **__: None)
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """The tensor stored under ``key`` (written into ``target_location`` when given), or None."""
        got = self.batch_get([key], [target_location])
        return got[0]

    @answers(no_tensors)
    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Per key: its tensor (a flat KV page without a target), or None when it is not cached.
        Fewer targets than keys: the keys without one are not read (as HiCacheFile's zip)."""
        targets = list(target_locations or [None] * len(keys))
        keys, targets = keys[: len(targets)], targets[: len(keys)]  # as HiCacheFile's zip
        if not keys:
            return []
        found: list[torch.Tensor | None] = [None] * len(keys)
        link = self._links.get(KV_POOL)
        paged = [i for i, t in enumerate(targets) if link is not None and self._fits(t) is link]
        if link is not None and paged:
            outs = [targets[i] if targets[i] is not None else link.binding.empty_flat_page() for i in paged]
            daemon_keys = link.keys.daemon_keys([keys[i] for i in paged])
            try:
                loaded = link.load_each(
                    daemon_keys, lambda lo, hi: link.get_flat(daemon_keys[lo:hi], outs[lo:hi])
                )
            except HiCacheError as exc:
                if exc.code in GIVE_UP:
                    raise
                self.failures.refused(f"pool {KV_POOL}", len(paged), str(exc))
                loaded = []
            for j, hit in enumerate(loaded):
                if hit:
                    found[paged[j]] = outs[j]
        for i, key in enumerate(keys):
            # Not a page of the pool, or not found there: the byte path.
            if found[i] is None:
                found[i] = self._safe(lambda: self._blobs.get(key, targets[i]), None)  # noqa: B023
        return found

    @answers(lambda *_, **__: False)
    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store tensor ``value`` under ``key`` (True also when it was already stored)."""
        return self.batch_set([key], [value])

    @answers(lambda *_, **__: False)
    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        """Store tensors; True when every key is stored (or already was), False from the first failure.
        Fewer values than keys: the keys without one are not stored (as HiCacheFile's zip)."""
        if values is None:  # HiCacheFile raises (zip over None); nothing is stored either way
            log.error("hicached: batch_set of %d keys without values; nothing stored", len(keys))
            return not keys
        values = list(values)  # a stacked tensor has no truth value
        if len(values) != len(keys):
            log.warning(
                "hicached: batch_set of %d keys with %d values: the extra are left out",
                len(keys),
                len(values),
            )
            keys, values = keys[: len(values)], values[: len(keys)]
        if not keys:
            return True
        if not all(isinstance(v, torch.Tensor) for v in values):
            log.error("hicached: batch_set values must be tensors; nothing stored")
            return False
        # Stored as their bytes in order, as HiCacheFile writes them: a page SGLang hands over
        # unflattened (get_data_page(flat=False)) is still a page of the pool.
        values = [v.contiguous() for v in values]
        link = self._links.get(KV_POOL)
        if link is not None and all(self._fits(v) is link for v in values):
            try:
                return all(once_each(link.keys.daemon_keys(keys), values, link.put_flat))
            except HiCacheError as exc:
                self._not_stored(KV_POOL, len(keys), exc)
                return False
        for key, value in zip(keys, values, strict=True):
            if self._fits(value) is not None and link is not None:
                ok = self.batch_set([key], [value])
            else:
                ok = self._safe(lambda: self._blobs.put(key, value), False)  # noqa: B023
            if not ok:
                return False
        return True

    @answers(lambda *_, **__: False)
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    @answers(lambda *_, **__: 0)
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Leading run of ``keys`` cached in the daemon (L2, and L3 unless disabled).

        A key counts when it is a page of the KV pool or a tensor stored by key
        (the byte path), as every key is one file for ``HiCacheFile``.
        """
        link = self._links.get(KV_POOL)
        run = 0
        while run < len(keys):
            if link is not None:
                rest = link.keys.daemon_keys(keys[run:])
                run += self._safe(lambda: link.exists(rest), 0)  # noqa: B023
                if run == len(keys):
                    break
            if not self._safe(lambda: self._blobs.exists(keys[run]), False):  # noqa: B023
                break
            run += 1
        return run

    # ----------------------------------------------------------- management

    @answers(lambda *_, **__: False)
    def clear(self) -> bool:
        """Drop this model's pages and tensors (this tenant's only, when a tenant is set) from L2
        and L3: every group of the model, the byte path's included."""

        def clear(session: Any) -> Any:
            # A worker clears only its own tenant, naming its session (the daemon checks both).
            return self._client.clear_namespace(
                self.model_name,
                self.config.tenant,
                session_id=session.session_id,
                session_secret=session.info.session_secret,
            )

        try:
            link = self._links.get(KV_POOL)
            if link is not None:
                result = link.call(lambda session, _: clear(session))
            else:  # no pool registered yet: the byte path's session can ask as well
                result = self._blobs.call(clear)
        except HiCacheError as exc:
            log.error("hicached: clear of model %r failed: %s", self.model_name, exc)
            return False
        log.info("hicached: cleared model %r (%s)", self.model_name, result)
        return True

    def get_stats(self) -> Any:
        """SGLang ``StorageMetrics`` of the I/O since the last call (None when metrics are off)."""
        if not self._metrics_enabled:
            return None
        from sglang.srt.observability.metrics_collector import (  # type: ignore[import-untyped]
            StorageMetrics,
        )

        return StorageMetrics(**self._io.drain())

    def close(self) -> None:
        """Detach every pool session, free the staging areas, close the channel (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            links = list(dict.fromkeys(self._links.values()))
        for link in links:
            try:
                link.close()
            except HiCacheError as exc:
                log.warning("hicached: detaching pool %s failed: %s", link.keys.pool, exc)
        try:
            self._blobs.close()
        except HiCacheError as exc:
            log.warning("hicached: detaching the byte-path store failed: %s", exc)
        self._client.close()

    def key_space(self, pool: str = KV_POOL) -> KeySpace:
        """The daemon key space of a registered pool (KeyError when it is not registered)."""
        return self._links[pool].keys

    def _safe(self, fn: Callable[[], T], default: T) -> T:
        """``fn()``, or ``default`` (a miss, logged rate-limited) when it fails or a key cannot be
        sent; a daemon down or out of time (:data:`GIVE_UP`) ends the whole call instead."""
        try:
            return fn()
        except (HiCacheError, ValueError) as exc:
            if isinstance(exc, HiCacheError) and exc.code in GIVE_UP:
                raise
            self._failed_calls.refused("call", 1, str(exc))
            return default
