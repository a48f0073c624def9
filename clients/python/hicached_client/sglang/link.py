"""One SGLang host pool attached to the daemon: a session, a staging area, a transport
(:mod:`.transports`: how the pages move).

``PoolLink`` is what the SGLang backend class calls per pool. Its operations
take daemon keys (already namespaced) and host page numbers, run one RPC per
batch of at most ``staging_pages`` pages (fewer on the byte path: ``BYTES_PER_CALL``), and report SGLang's semantics:
writes succeed for keys already cached (the daemon skips them), a read loads
the leading run of hits (:meth:`PoolLink.load_each` goes on after a miss), a
missing key is a miss and never an error.

Thread-safety: every method may be called from any thread. Writes serialise
on the write half of the staging area, reads on the read half, so SGLang's
backup and prefetch threads run concurrently. Ownership: SGLang owns the host
pool; the link owns the staging area and the session, both released by
:meth:`close` exactly once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
import torch

from hicached_client import pool_spec
from hicached_client.errors import HiCacheError
from hicached_client.sglang.config import AdapterConfig, Transport
from hicached_client.sglang.layouts import PoolBinding
from hicached_client.sglang.namespace import KeySpace
from hicached_client.sglang.refusals import RefusalLog
from hicached_client.sglang.staging import StagingArea
from hicached_client.sglang.transports import (
    DAEMON_POOL,
    BytesTransport,
    Drain,
    Fill,
    PageTransport,
    ShmTransport,
    ZeroCopyTransport,
    answer_too_large,
    as_zero_copy,
)
from hicached_client.sglang.zerocopy import plan as zero_copy_plan
from hicached_client.sync import HiCacheClient, Session
from hicached_client.types import PoolRole, WorkerIdentity

log = logging.getLogger(__name__)

T = TypeVar("T")
# The daemon does not know the session (any more): restarted daemon, expired lease.
SESSION_GONE = frozenset({grpc.StatusCode.NOT_FOUND})


class PoolLink:
    """A daemon session for one SGLang host pool (see the module docstring).

    When the daemon no longer knows the session (it restarted, or the lease
    ran out), the link attaches again with a fresh staging area and retries
    the call once; other errors propagate to the caller.
    """

    def __init__(
        self,
        client: HiCacheClient,
        *,
        config: AdapterConfig,
        identity: WorkerIdentity,
        binding: PoolBinding,
        keys: KeySpace,
        segment_name: str,
        refusals: RefusalLog | None = None,
    ) -> None:
        self.binding = binding
        self._refusals = refusals
        self.keys = keys
        self._client = client
        self._config = config
        self._identity = identity
        self._segment_prefix = segment_name
        self._attaches = 0
        self._closed = False
        self._lock = threading.Lock()
        # "zero-copy" (daemon maps the host pool), "staging" or "bytes"; set by _connect.
        self.path = ""
        self.session, self._staging, self.transport = self._connect()

    def _connect(self) -> tuple[Session, StagingArea | None, PageTransport]:
        config, g = self._config, self.binding.geometry
        shm = config.transport is Transport.SHM
        staging: StagingArea | None = None
        k_bufs: list[Any] = []
        v_bufs: list[Any] = []
        self._attaches += 1
        zero_copy = zero_copy_plan(self.binding.host_pool, self.binding) if shm else None
        if zero_copy is not None and zero_copy.ok:
            k_bufs, v_bufs = zero_copy.k_buffers, zero_copy.v_buffers
        elif shm:
            half = max(1, min(config.staging_pages, config.staging_bytes // g.page_bytes))
            staging = StagingArea(f"{self._segment_prefix}-{self._attaches}", g, half)
        path = "zero-copy" if zero_copy is not None and zero_copy.ok else "staging" if shm else "bytes"
        try:
            if staging is not None:
                k_bufs, v_bufs = staging.device_buffers()
            # Without buffers the session is byte-only (PutBytes/GetBytes): no shared
            # memory with the daemon at all, so the daemon may run on another host.
            spec = pool_spec(
                DAEMON_POOL,
                role=PoolRole.ANCHOR,
                kind=g.kind,
                dtype=g.dtype,
                page_size=g.rows_per_page,
                num_layers=g.num_layers,
                num_heads=g.heads,
                head_dim=g.head_dim,
                k_buffers=k_bufs,
                v_buffers=v_bufs,
                host_layout=g.host_layout,
                host_bytes=config.host_bytes or max(self.binding.host_bytes(), g.page_bytes),
                data_path=path,  # shown per session by `hicached status`
            )
            session = self._client.attach(
                self._identity, [spec], lease_ms=config.lease_ms, timeout_s=config.timeout_s
            )
        except BaseException:
            if staging is not None:
                staging.close()
            raise
        transport: PageTransport
        if path == "zero-copy":
            transport = ZeroCopyTransport(session, self.binding, config)
        elif staging is not None:
            # The daemon has mapped the memfd; unlink() is a no-op kept for symmetry.
            staging.unlink()
            transport = ShmTransport(session, staging, config)
        else:
            transport = BytesTransport(session, self.binding, config)
        self.path = path
        log.info(
            "hicached: pool %s attached (session %s, %s transport, path %s%s, %d-byte pages, joined=%s)",
            self.keys.pool,
            session.session_id,
            config.transport.value,
            self.path,
            f" [zero-copy not used: {zero_copy.reason}]"
            if zero_copy is not None and not zero_copy.ok
            else "",
            g.page_bytes,
            session.info.joined_existing_group,
        )
        return session, staging, transport

    def call(self, op: Callable[[Session, PageTransport], T]) -> T:
        """Run ``op`` with the live session (attaching again once if it was lost)."""
        return self._call(op)

    def _call(self, op: Callable[[Session, PageTransport], T]) -> T:
        session, transport = self.session, self.transport
        try:
            return op(session, transport)
        except HiCacheError as exc:
            if exc.code not in SESSION_GONE:
                raise
            log.warning(
                "hicached: pool %s lost session %s (%s); attaching again",
                self.keys.pool,
                session.session_id,
                exc,
            )
        self._reconnect(session)
        return op(self.session, self.transport)

    def _reconnect(self, lost: Session) -> None:
        with self._lock:
            if self._closed:
                raise HiCacheError(grpc.StatusCode.CANCELLED, f"pool {self.keys.pool} link is closed")
            if self.session is not lost:
                return  # another thread already attached again
            old_transport = self.transport
            self.session, self._staging, self.transport = self._connect()
        lost.stop_heartbeat()
        if isinstance(old_transport, ShmTransport):
            old_transport.close()  # waits for a put or get another thread runs on it

    # ------------------------------------------------------------- queries

    def exists(self, keys: Sequence[str]) -> int:
        """Leading run of ``keys`` cached (L2, and L3 when ``include_l3``). A batch refused for
        one of its keys (the daemon's INVALID_ARGUMENT for a key over ``limits.max_key_bytes``,
        or a key that cannot be sent: a lone surrogate) is asked key by key up to that one, as
        HiCacheFile's per-key files answer (no file can have such a key's name)."""
        try:
            return self._exists(keys)
        except (HiCacheError, UnicodeError) as exc:
            if not _a_key_refused(exc) or len(keys) == 1:
                raise
        run = 0
        while run < len(keys):
            try:
                if not self._exists(keys[run : run + 1]):
                    break
            except (HiCacheError, UnicodeError) as exc:
                if not _a_key_refused(exc):
                    raise
                break
            run += 1
        return run

    def _exists(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        result = self._call(lambda session, _: session.lookup(list(keys), tenant=self._config.tenant))
        return result.total_hit_pages if self._config.include_l3 else result.l2_hit_pages

    def membership(self, keys: Sequence[str]) -> list[bool]:
        """Which of ``keys`` are cached (L2, and L3 when ``include_l3``): one per-key Lookup."""
        if not keys:
            return []
        result = self._call(
            lambda session, _: session.lookup(list(keys), tenant=self._config.tenant, per_key=True)
        )
        return list(result.cached if self._config.include_l3 else result.in_l2)

    def load_each(self, keys: Sequence[str], load: Callable[[int, int], int]) -> list[bool]:
        """Per key: loaded, as ``HiCacheFile`` reads every key's file. ``load(lo, hi)`` loads
        the leading cached run of ``keys[lo:hi]`` and returns its length.

        One load of all keys; only after a miss, one per-key Lookup of the keys after it
        and one load per run of cached ones. An error after the first load is logged and
        ends the call with what was loaded (those pages are in place); the first raises.
        """
        loaded = [False] * len(keys)
        hits = load(0, len(keys))
        loaded[:hits] = [True] * hits
        rest = hits + 1  # keys[hits] just missed
        if rest >= len(keys):
            return loaded
        try:
            cached = self.membership(keys[rest:])
            for lo, hi in _runs(cached):
                got = load(rest + lo, rest + hi)
                loaded[rest + lo : rest + lo + got] = [True] * got
        except HiCacheError as exc:
            log.warning("hicached: loading the pages after a miss failed: %s", exc)
        return loaded

    # ---------------------------------------------------------------- copies

    def put_pages(self, keys: Sequence[str], host_pages: torch.Tensor) -> list[bool]:
        """Store host pages under ``keys`` (``host_pages[i]`` pairs with ``keys[i]``)."""
        if isinstance(self.transport, ZeroCopyTransport):
            return self._put_host(keys, host_pages.tolist())
        return self._put(keys, lambda lo, hi: lambda out: self.binding.gather(host_pages[lo:hi], out))

    def put_flat(self, keys: Sequence[str], pages: Sequence[torch.Tensor]) -> list[bool]:
        """Store SGLang flat data pages under ``keys``."""
        chunks = [self.binding.flat_to_chunks(p) for p in pages]

        def filler(lo: int, hi: int) -> Fill:
            def fill(out: torch.Tensor) -> None:
                for i in range(lo, hi):
                    out[:, i - lo].copy_(chunks[i])

            return fill

        return self._put(keys, filler)

    def get_pages(self, keys: Sequence[str], host_pages: torch.Tensor) -> int:
        """Load the leading run of cached ``keys`` into ``host_pages``; returns its length."""

        if isinstance(self.transport, ZeroCopyTransport):
            return self._get_host(keys, host_pages.tolist())

        def drainer(lo: int, hi: int) -> Drain:
            return lambda src: self.binding.scatter(host_pages[lo : lo + src.shape[1]], src)

        return self._get(keys, drainer)

    def get_flat(self, keys: Sequence[str], outs: Sequence[torch.Tensor]) -> int:
        """Load the leading run of cached ``keys`` into flat data pages ``outs``."""
        if not all(o.is_contiguous() for o in outs):
            raise ValueError("flat target pages must be contiguous tensors")
        views = [self.binding.flat_to_chunks(o) for o in outs]

        def drainer(lo: int, hi: int) -> Drain:
            def drain(src: torch.Tensor) -> None:
                for i in range(src.shape[1]):
                    views[lo + i].copy_(src[:, i])

            return drain

        return self._get(keys, drainer)

    def _put(self, keys: Sequence[str], filler: Callable[[int, int], Fill]) -> list[bool]:
        results: list[bool] = []
        cap = self.transport.capacity
        for lo in range(0, len(keys), cap):
            hi = min(lo + cap, len(keys))
            batch, fill = keys[lo:hi], filler(lo, hi)
            ok = self._store(hi - lo, lambda _, transport: transport.put(batch, fill))  # noqa: B023 - called at once
            results.extend([ok] * (hi - lo))
        return results

    def _put_host(self, keys: Sequence[str], pages: list[int]) -> list[bool]:
        results: list[bool] = []
        cap = as_zero_copy(self.transport).host_capacity
        for lo in range(0, len(keys), cap):
            hi = min(lo + cap, len(keys))
            batch, idx = keys[lo:hi], pages[lo:hi]
            ok = self._store(hi - lo, lambda _, t: as_zero_copy(t).put_host(batch, idx))  # noqa: B023 - called at once
            results.extend([ok] * (hi - lo))
        return results

    def _store(self, pages: int, op: Callable[[Session, PageTransport], str | None]) -> bool:
        """One batch's write: True when stored. A refusal -- ``ok=false``, or RESOURCE_EXHAUSTED
        (a configured limit, backpressure) -- is False, logged rate-limited with the daemon's reason."""
        try:
            refused = self._call(op)
        except HiCacheError as exc:
            if exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            refused = exc.message
        if refused is not None and self._refusals is not None:
            self._refusals.refused(self.keys.pool, pages, refused)
        return refused is None

    def _get_host(self, keys: Sequence[str], pages: list[int]) -> int:
        loaded = 0
        cap = as_zero_copy(self.transport).host_capacity
        for lo in range(0, len(keys), cap):
            hi = min(lo + cap, len(keys))
            batch, idx = keys[lo:hi], pages[lo:hi]
            hits = self._call(lambda _, t: as_zero_copy(t).get_host(batch, idx))  # noqa: B023 - called at once
            loaded += hits
            if hits < hi - lo:
                break
        return loaded

    def _get(self, keys: Sequence[str], drainer: Callable[[int, int], Drain]) -> int:
        loaded = lo = 0
        while lo < len(keys):
            hi = min(lo + self.transport.capacity, len(keys))
            batch, drain = keys[lo:hi], drainer(lo, hi)
            try:
                hits = self._call(lambda _, transport: transport.get(batch, drain))  # noqa: B023 - called at once
            except HiCacheError as exc:
                if not answer_too_large(exc) or hi - lo == 1:
                    raise
                # The daemon answers less per call than BYTES_PER_CALL (its limit is lower):
                # this batch and the later ones go in halves.
                self.transport.capacity = max(1, (hi - lo) // 2)
                continue
            loaded += hits
            if hits < hi - lo:
                break
            lo = hi
        return loaded

    def close(self) -> None:
        """Detach the session and free the staging area (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self.session.close()
        finally:
            if isinstance(self.transport, ShmTransport):
                self.transport.close()
            elif self._staging is not None:
                self._staging.close()


def _runs(flags: Sequence[bool]) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` bounds of every run of True in ``flags``."""
    out: list[tuple[int, int]] = []
    start = None
    for i, flag in enumerate([*flags, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            out.append((start, i))
            start = None
    return out


def _a_key_refused(exc: Exception) -> bool:
    """Whether ``exc`` refused a batch for one of its keys (see :meth:`PoolLink.exists`)."""
    return isinstance(exc, UnicodeError) or (
        isinstance(exc, HiCacheError) and exc.code == grpc.StatusCode.INVALID_ARGUMENT
    )


def once_each(keys: list[str], items: Any, put: Callable[[list[str], Any], list[bool]]) -> list[bool]:
    """``put(keys, items)`` with each key once (the daemon refuses a batch that repeats one;
    HiCacheFile stores it once): the first of a repeated key is stored, and every place of it
    gets that answer."""
    if len(set(keys)) == len(keys):
        return put(keys, items)
    first: dict[str, int] = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    picked = list(first.values())
    chosen = items[picked] if isinstance(items, torch.Tensor) else [items[i] for i in picked]
    done = dict(zip(first, put(list(first), chosen), strict=True))
    return [done[key] for key in keys]
