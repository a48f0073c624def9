"""One SGLang host pool attached to the daemon: a session, a staging area, a transport.

``PoolLink`` is what the SGLang backend class calls per pool. Its operations
take daemon keys (already namespaced) and host page numbers, run one RPC per
batch of at most ``staging_pages`` pages, and report SGLang's semantics:
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

import abc
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
from hicached_client.sglang.zerocopy import plan as zero_copy_plan
from hicached_client.sync import HiCacheClient, Session
from hicached_client.types import PageBytes, PoolRole, WorkerIdentity
from hicached_client.types import Transfer as WireTransfer

log = logging.getLogger(__name__)

# The daemon's name for the single pool of every adapter session.
DAEMON_POOL = "kv"

T = TypeVar("T")
# The daemon does not know the session (any more): restarted daemon, expired lease.
SESSION_GONE = frozenset({grpc.StatusCode.NOT_FOUND})

Fill = Callable[[torch.Tensor], None]
Drain = Callable[[torch.Tensor], None]


class PageTransport(abc.ABC):
    """Moves one batch (at most ``capacity`` pages) between chunk tensors and the daemon.

    ``put`` calls ``fill(out)`` with a ``(groups, n, chunk_bytes)`` tensor to
    fill, then stores it, returning None, or the daemon's reason when it
    refused the write (no room, over budget: nothing stored); ``get`` loads the leading run of hits and calls
    ``drain(src)`` with a ``(groups, hits, chunk_bytes)`` tensor. Thread-safe.
    """

    capacity: int

    @abc.abstractmethod
    def put(self, keys: Sequence[str], fill: Fill) -> str | None: ...

    @abc.abstractmethod
    def get(self, keys: Sequence[str], drain: Drain) -> int: ...


class ShmTransport(PageTransport):
    """Pages cross through the staging area; messages carry page indices only."""

    def __init__(self, session: Session, staging: StagingArea, config: AdapterConfig) -> None:
        self._session = session
        self._staging = staging
        self._tenant = config.tenant
        self._include_l3 = config.include_l3
        self.capacity = staging.half
        self._write_lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        """Free the staging area once no put or get of this transport uses it (a link that
        attached again closes its old transport while other threads may still hold it)."""
        with self._write_lock, self._read_lock:
            self._closed = True
            self._staging.close()

    def _check_open(self) -> None:
        if self._closed:  # replaced: NOT_FOUND makes the link run the call on the new one
            raise HiCacheError(grpc.StatusCode.NOT_FOUND, "the staging area was replaced by a new session's")

    def put(self, keys: Sequence[str], fill: Fill) -> str | None:
        n = len(keys)
        with self._write_lock:
            self._check_open()
            fill(self._staging.write_half()[:, :n])
            pages = list(self._staging.write_pages[:n])
            result = self._session.put_pages(keys, [WireTransfer(DAEMON_POOL, pages)], tenant=self._tenant)
        return None if result.ok else result.reason

    def get(self, keys: Sequence[str], drain: Drain) -> int:
        n = len(keys)
        with self._read_lock:
            self._check_open()
            pages = list(self._staging.read_pages[:n])
            result = self._session.get_pages(
                keys, [WireTransfer(DAEMON_POOL, pages)], include_l3=self._include_l3, tenant=self._tenant
            )
            hits = min(result.hit_pages, n)
            if hits:
                drain(self._staging.read_half()[:, :hits])
        return hits


# A GetBytes answer carries its pages' bytes, and the daemon refuses one past its
# limits.max_response_bytes (32 MiB by default) however many it holds: a byte-path batch keeps
# to half of that (128 pages of 1 MiB were refused whole, so such pages never read back).
BYTES_PER_CALL = 16 << 20


class BytesTransport(PageTransport):
    """Fallback: page bytes inside PutBytes / GetBytes messages (no shared memory)."""

    def __init__(self, session: Session, binding: PoolBinding, config: AdapterConfig) -> None:
        self._session = session
        self._geometry = binding.geometry
        self._tenant = config.tenant
        self._include_l3 = config.include_l3
        page_bytes = binding.geometry.groups * binding.geometry.chunk_bytes
        self.capacity = max(1, min(config.staging_pages, BYTES_PER_CALL // page_bytes))

    def put(self, keys: Sequence[str], fill: Fill) -> str | None:
        g = self._geometry
        chunks = torch.empty((g.groups, len(keys), g.chunk_bytes), dtype=torch.uint8)
        fill(chunks)
        pages = chunks.permute(1, 0, 2).contiguous().numpy()
        try:
            self._session.put_bytes(
                [PageBytes(key, DAEMON_POOL, pages[i].tobytes()) for i, key in enumerate(keys)],
                tenant=self._tenant,
            )
        except HiCacheError as exc:
            # PutBytes refuses with RESOURCE_EXHAUSTED, the reason in the message.
            if exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            return exc.message
        return None

    def get(self, keys: Sequence[str], drain: Drain) -> int:
        g = self._geometry
        result = self._session.get_bytes(keys, include_l3=self._include_l3, tenant=self._tenant)
        # The leading run of pages that are what was asked for: the key, one whole page each.
        size, hits = g.groups * g.chunk_bytes, 0
        for page, key in zip(result.pages[: min(result.hit_pages, len(keys))], keys, strict=False):
            if page.key != key or len(page.data) != size:
                break
            hits += 1
        if hits:
            flat = torch.frombuffer(
                bytearray(b"".join(p.data for p in result.pages[:hits])), dtype=torch.uint8
            )
            drain(flat.view(hits, g.groups, g.chunk_bytes).permute(1, 0, 2))
        return hits


class ZeroCopyTransport(BytesTransport):
    """The daemon maps the host pool itself: page batches name host page numbers.

    ``put_host`` / ``get_host`` move pages with no copy in this process;
    ``put`` / ``get`` (flat pages of the generic API, which are not in the host
    pool) are the byte path inherited from :class:`BytesTransport`.
    """

    def __init__(self, session: Session, binding: PoolBinding, config: AdapterConfig) -> None:
        super().__init__(session, binding, config)
        # Its batches carry page numbers, not bytes: up to staging_pages, as SGLang's batch.
        self.host_capacity = config.staging_pages

    def put_host(self, keys: Sequence[str], host_pages: Sequence[int]) -> str | None:
        result = self._session.put_pages(
            keys, [WireTransfer(DAEMON_POOL, list(host_pages))], tenant=self._tenant
        )
        return None if result.ok else result.reason

    def get_host(self, keys: Sequence[str], host_pages: Sequence[int]) -> int:
        result = self._session.get_pages(
            keys,
            [WireTransfer(DAEMON_POOL, list(host_pages))],
            include_l3=self._include_l3,
            tenant=self._tenant,
        )
        return min(result.hit_pages, len(keys))


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
        """Leading run of ``keys`` cached (L2, and L3 when ``include_l3``)."""
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
        cap = _zero_copy(self.transport).host_capacity
        for lo in range(0, len(keys), cap):
            hi = min(lo + cap, len(keys))
            batch, idx = keys[lo:hi], pages[lo:hi]
            ok = self._store(hi - lo, lambda _, t: _zero_copy(t).put_host(batch, idx))  # noqa: B023 - called at once
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
        cap = _zero_copy(self.transport).host_capacity
        for lo in range(0, len(keys), cap):
            hi = min(lo + cap, len(keys))
            batch, idx = keys[lo:hi], pages[lo:hi]
            hits = self._call(lambda _, t: _zero_copy(t).get_host(batch, idx))  # noqa: B023 - called at once
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
                if not _answer_too_large(exc) or hi - lo == 1:
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


def _answer_too_large(exc: HiCacheError) -> bool:
    """The daemon refused an answer for its size (a configured limit), not its content."""
    limits = ("limits.max_response_bytes", "server.max_message_bytes")
    return exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED and any(key in exc.message for key in limits)


def _zero_copy(transport: PageTransport) -> ZeroCopyTransport:
    """``transport`` as the zero-copy one (a re-attach keeps the path it was decided with)."""
    if not isinstance(transport, ZeroCopyTransport):
        raise HiCacheError(grpc.StatusCode.FAILED_PRECONDITION, "pool link lost its zero-copy path")
    return transport
