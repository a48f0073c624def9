"""gRPC servicers: convert messages, run the core on a thread pool, map errors.

Each method is thin: check limits -> parse -> core call -> build response. The
event loop only parses, authorizes, checks O(1) limits and schedules: every call
that blocks or is proportional to a request's size runs on one of the bounded
lanes of :mod:`hicached.server.lanes` (copies, L3, hashing, bookkeeping; page
bookkeeping excepted: see ``run_bookkeeping``). The ``[limits]`` are checked
before any work starts (:mod:`hicached.server.limits`). Errors become status
codes through ``status.status_for`` (one table); anything else is a bug and
becomes INTERNAL with the error logged. A message quotes at most a short prefix
of any client value, and is cut at ``MAX_MESSAGE_CHARS`` whatever it holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from hicached_client.v1 import hicached_pb2 as pb
from hicached_client.v1 import hicached_pb2_grpc as pb_grpc
from hicached_client.v1 import types_pb2 as tpb

from hicached import __version__
from hicached.config import LimitsConfig
from hicached.core.keyed import KeyedCache
from hicached.core.service import HiCacheCore
from hicached.core.stats import DaemonStats
from hicached.core.types import Ack, PeerCred
from hicached.errors import FailedPrecondition, InvalidArgument, PermissionDenied, Unimplemented, clip
from hicached.index.keys import page_keys
from hicached.index.types import PrefetchState
from hicached.l3.stats_cache import StatsCache
from hicached.server import convert
from hicached.server.handoff import HandoffRegistry
from hicached.server.lanes import Lanes
from hicached.server.limits import (
    check_buffers,
    check_count,
    check_identity,
    check_ids,
    check_keys,
    check_response,
)
from hicached.server.peers import PeerSessions, peer_key
from hicached.server.roles import Access
from hicached.server.status import status_for, trailing_metadata_for

logger = logging.getLogger(__name__)
T = TypeVar("T")
RpcObserver = Callable[[str, grpc.StatusCode, float], None]
Ctx = grpc.aio.ServicerContext[Any, Any]
# Metadata key of the session capability (AttachResponse.session_secret).
SESSION_SECRET_METADATA = "x-hicached-session-secret"
# An error message longer than this is cut (gRPC carries it in a header).
MAX_MESSAGE_CHARS = 1024


def _noop_observer(method: str, code: grpc.StatusCode, seconds: float) -> None:
    """Default: no metrics."""


class _Base:
    def __init__(
        self,
        core: HiCacheCore,
        lanes: Lanes,
        *,
        observe: RpcObserver | None = None,
        access: Access,
        handoff: HandoffRegistry | None = None,
        peers: PeerSessions | None = None,
        l3_stats: StatsCache | None = None,
    ) -> None:
        self.core = core
        self.lanes = lanes
        self.limits: LimitsConfig = core.config.limits
        self._observe = observe or _noop_observer
        self.access = access
        self._handoff = handoff
        self._peers = peers
        self._l3_stats = l3_stats

    def authorize(self, context: Ctx) -> None:
        """TCP calls carry a configured bearer token (the listener's interceptor checks it too)."""
        self.access.authenticate(context.invocation_metadata())

    def is_admin(self, context: Ctx) -> bool:
        return self.access.is_admin(context.invocation_metadata())

    def check_session(self, request: Any, context: Ctx) -> None:
        """The one place a session's capability is checked: a request that names a
        ``session_id`` must carry that session's secret (PermissionDenied otherwise,
        before the handler runs, so nothing changes)."""
        session_id = getattr(request, "session_id", "")
        if not session_id:
            return
        secret = ""
        for key, value in context.invocation_metadata() or ():
            if key == SESSION_SECRET_METADATA and isinstance(value, str):
                secret = value
        self.core.check_secret(session_id, secret)

    def _anchor(self, session_id: str) -> str:
        return self.core.anchor_pool(session_id)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """On the copy lane (calls that wait for the copy engine)."""
        return await self.lanes.copy.run(fn, *args, **kwargs)

    async def run_l3(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """On the L3 lane (calls that may wait for the L3 backend; bounded queue)."""
        return await self.lanes.l3.run(fn, *args, **kwargs)

    async def run_book(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """On the bookkeeping lane (attach, stats: never behind copies or L3)."""
        return await self.lanes.bookkeeping.run(fn, *args, **kwargs)

    def has_l3(self) -> bool:
        return self.core.config.l3.backend != "none"

    async def run_bookkeeping(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Page bookkeeping (alloc/free/resolve/release): microseconds of work, so it runs on
        the event loop — the thread hop would cost more than the call (~200 us here). Under a
        write_back L3 an allocation may evict synchronously to L3, so it goes to the L3 lane then."""
        if self.core.allocation_may_block:
            return await self.run_l3(fn, *args, **kwargs)
        return fn(*args, **kwargs)

    async def fail(self, context: Ctx, method: str, exc: BaseException) -> None:
        code = status_for(exc)
        if context.cancelled() or context.done():
            # The client went away (it stopped reading a stream, or cancelled): nobody is left
            # to answer, and that is the client's choice, not a daemon error.
            if code is None:  # a bug stays a bug, whoever is listening
                logger.exception("internal error in %s", method, exc_info=exc)
            else:
                logger.debug("%s ended by the client: %s: %s", method, type(exc).__name__, exc)
            traceback.clear_frames(exc.__traceback__)
            return
        if code is None:
            logger.exception("internal error in %s", method, exc_info=exc)
            code, message = (
                grpc.StatusCode.INTERNAL,
                f"internal error in {method}: {type(exc).__name__}: {exc}",
            )
        elif isinstance(exc, OSError) and exc.errno is not None:
            # The daemon's own resources ran out (status.ExhaustedOSError): say which.
            name = errno.errorcode.get(exc.errno, str(exc.errno))
            message = (
                f"the daemon is out of resources in {method}: {name} ({exc.strerror}); retry later "
                "(descriptors: its RLIMIT_NOFILE; memory: host.budget; space: the L3 disk)"
            )
        else:
            message = str(exc)
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[:MAX_MESSAGE_CHARS] + f"... ({len(message)} chars)"
        # The failed call's finished frames may hold what it had opened (a partly mapped attach's
        # tensors keep their descriptors): release them now rather than at the next GC cycle.
        traceback.clear_frames(exc.__traceback__)
        context.set_trailing_metadata(trailing_metadata_for(exc))
        await context.abort(code, message)


def no_fence(ready: tpb.Fence) -> None:
    """Ready fences are not wired to the copy engine yet: refuse one rather than copy
    memory the worker may still be writing (a worker synchronises before the call)."""
    if ready.WhichOneof("kind") is not None:
        raise Unimplemented(
            "ready fences (cuda_ipc_event) are not supported yet: synchronise the worker's stream "
            "before Write/RetractBackup/PutPages and send no fence"
        )


def unary(method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Wrap a unary handler: error mapping and the per-RPC observation."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self: _Base, request: Any, context: Ctx) -> Any:
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            self.authorize(context)
            check_ids(request, self.limits)
            self.check_session(request, context)
            return await method(self, request, context)
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:
            code = status_for(exc) or grpc.StatusCode.INTERNAL
            await self.fail(context, name, exc)
        finally:
            self._observe(name, code, time.perf_counter() - start)

    return wrapper


class HiCacheServicer(_Base, pb_grpc.HiCacheServiceServicer):
    """hicached.v1.HiCacheService (session, host-page, data-plane and retraction RPCs)."""

    # ---- sessions

    @unary
    async def Attach(self, request: pb.AttachRequest, context: Ctx) -> pb.AttachResponse:
        peer, fds = self._take_handoff(request.handoff_ticket, context)
        try:
            check_identity(request.identity, self.limits)
            check_buffers(request.pools, self.limits)
            worker = convert.worker_id(request.identity)
            check_tenant(worker.tenant)
            pools = [convert.pool_request(p, i, fds) for i, p in enumerate(request.pools)]
            key = peer_key(peer, context.peer())
            if self._peers is not None:
                self._peers.reserve(key)
            session_id = None
            try:
                result = await self.run_book(
                    self.core.attach, worker, pools, lease_ms=request.lease_ms, peer=peer
                )
                session_id = result.session_id
            finally:
                if self._peers is not None:
                    self._peers.settle(key, session_id)
        finally:
            # Mapped buffers keep their memory; the descriptors are not needed after the attach.
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        return pb.AttachResponse(
            session_secret=result.session_secret,
            session_id=result.session_id,
            lease_ms=result.lease_ms,
            pools=[convert.pool_info(p) for p in result.pools],
            joined_existing_group=result.joined_existing_group,
            replaced_session_id=result.replaced_session_id,
        )

    def _take_handoff(self, ticket: str, context: Ctx) -> tuple[PeerCred | None, list[int]]:
        """The peer and fds of an attach's handoff ticket (consumed); the caller closes the fds."""
        if not ticket:
            return None, []
        if not context.peer().startswith("unix:"):
            raise InvalidArgument(
                "handoff_ticket over TCP: file descriptors can only be handed over on the Unix socket; "
                "attach byte-only (no device buffers) from another host"
            )
        if self._handoff is None:
            raise FailedPrecondition("this server has no fd handoff socket; attach without handoff_ticket")
        taken = self._handoff.take(ticket)
        if taken is None:
            raise PermissionDenied(
                f"handoff ticket {clip(ticket, 8)} is unknown, expired or already used: hand the fds "
                "over again right before Attach (each ticket serves one Attach)"
            )
        return taken

    @unary
    async def Detach(self, request: pb.DetachRequest, context: Ctx) -> pb.DetachResponse:
        freed = await self.run(self.core.detach, request.session_id, request.op_id)
        return pb.DetachResponse(freed_pages=freed)

    @unary
    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Ctx) -> pb.HeartbeatResponse:
        return pb.HeartbeatResponse(lease_expires_unix_ms=self.core.heartbeat(request.session_id))

    # ---- host pages

    @unary
    async def Alloc(self, request: pb.AllocRequest, context: Ctx) -> pb.AllocResponse:
        pages = await self.run_bookkeeping(
            self.core.alloc, request.session_id, request.op_id, request.pool, request.num_pages
        )
        if pages is None:
            return pb.AllocResponse(ok=False)
        return pb.AllocResponse(ok=True, host_pages=pages.tolist())

    @unary
    async def Free(self, request: pb.FreeRequest, context: Ctx) -> pb.FreeResponse:
        freed = await self.run_bookkeeping(
            self.core.free, request.session_id, request.op_id, request.pool, list(request.host_pages)
        )
        return pb.FreeResponse(freed_pages=freed)

    @unary
    async def ResolveTransfers(
        self, request: pb.ResolveTransfersRequest, context: Ctx
    ) -> pb.ResolveTransfersResponse:
        transfers = convert.batch_in(request.batch, self._anchor(request.session_id))
        result = await self.run_bookkeeping(self.core.resolve, request.session_id, request.op_id, transfers)
        return pb.ResolveTransfersResponse(ok=result.ok, batch=convert.batch_out(result.transfers))

    @unary
    async def ReleaseTransfers(
        self, request: pb.ReleaseTransfersRequest, context: Ctx
    ) -> pb.ReleaseTransfersResponse:
        transfers = [convert.transfer_in(t) for t in request.transfers]
        freed = await self.run_bookkeeping(self.core.release, request.session_id, request.op_id, transfers)
        return pb.ReleaseTransfersResponse(freed_pages=freed)

    # ---- data plane

    @unary
    async def Write(self, request: pb.WriteRequest, context: Ctx) -> pb.WriteResponse:
        no_fence(request.ready)
        transfers = convert.batch_in(request.batch, self._anchor(request.session_id))
        result = await self.run(
            self.core.write, request.session_id, request.op_id, transfers, allocate=request.allocate
        )
        return pb.WriteResponse(
            ok=result.ok, batch=convert.batch_out(result.transfers), acks=convert.acks_out(result.acks)
        )

    async def _stream_load(
        self,
        name: str,
        context: Ctx,
        layer_progress: bool,
        call: Callable[[Callable[[int], None] | None], tuple[Ack, ...]],
        request: Any = None,
    ) -> AsyncIterator[pb.LoadProgress]:
        """Run a layer-by-layer copy and stream one message per finished layer."""
        start = time.perf_counter()
        code = grpc.StatusCode.OK
        loop = asyncio.get_running_loop()
        layers: asyncio.Queue[int] = asyncio.Queue()

        def on_layer(layer: int) -> None:
            loop.call_soon_threadsafe(layers.put_nowait, layer)

        try:
            self.authorize(context)
            check_ids(request, self.limits)
            self.check_session(request, context)
            task = asyncio.ensure_future(self.run(call, on_layer if layer_progress else None))
            while True:
                getter = asyncio.ensure_future(layers.get())
                done, _ = await asyncio.wait({task, getter}, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    yield pb.LoadProgress(layer=getter.result())
                    continue
                getter.cancel()
                break
            while not layers.empty():
                yield pb.LoadProgress(layer=layers.get_nowait())
            acks = task.result()
            yield pb.LoadProgress(layer=-1, done=True, acks=convert.acks_out(acks))
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:
            code = status_for(exc) or grpc.StatusCode.INTERNAL
            await self.fail(context, name, exc)
        finally:
            self._observe(name, code, time.perf_counter() - start)

    async def Load(self, request: pb.LoadRequest, context: Ctx) -> AsyncIterator[pb.LoadProgress]:
        def call(on_layer: Callable[[int], None] | None) -> tuple[Ack, ...]:
            transfers = convert.batch_in(request.batch, self._anchor(request.session_id))
            return self.core.load(request.session_id, request.op_id, transfers, on_layer=on_layer)

        async for msg in self._stream_load("Load", context, request.layer_progress, call, request):
            yield msg

    # ---- retraction

    @unary
    async def RetractBackup(self, request: pb.RetractBackupRequest, context: Ctx) -> pb.RetractBackupResponse:
        no_fence(request.ready)
        transfers = convert.batch_in(request.batch, self._anchor(request.session_id))
        result = await self.run(
            self.core.retract_backup,
            request.session_id,
            request.op_id,
            request.request_id,
            transfers,
            num_tokens=request.num_tokens,
            lease_ms=request.lease_ms,
        )
        return pb.RetractBackupResponse(
            ok=result.ok,
            backup_id=result.backup_id,
            lease_expires_unix_ms=result.lease_expires_unix_ms,
            acks=convert.acks_out(result.acks),
        )

    async def RetractRestore(
        self, request: pb.RetractRestoreRequest, context: Ctx
    ) -> AsyncIterator[pb.LoadProgress]:
        def call(on_layer: Callable[[int], None] | None) -> tuple[Ack, ...]:
            transfers = convert.batch_in(request.batch, self._anchor(request.session_id))
            return self.core.retract_restore(
                request.session_id, request.op_id, request.backup_id, transfers, on_layer=on_layer
            )

        async for msg in self._stream_load("RetractRestore", context, request.layer_progress, call, request):
            yield msg

    @unary
    async def RetractDiscard(
        self, request: pb.RetractDiscardRequest, context: Ctx
    ) -> pb.RetractDiscardResponse:
        freed = await self.run_bookkeeping(
            self.core.retract_discard, request.session_id, request.op_id, request.backup_id
        )
        return pb.RetractDiscardResponse(freed_pages=freed)

    # ---- observability

    @unary
    async def GetStats(self, request: pb.GetStatsRequest, context: Ctx) -> pb.GetStatsResponse:
        stats = await self.run_book(self.core.stats, request.session_id)
        backends = await self.backend_infos()
        if self.is_admin(context):
            return stats_out(stats, backends)
        return worker_view(stats_out(stats, backends), own=bool(request.session_id))

    async def backend_infos(self) -> list[pb.BackendInfo]:
        """L3 backend stats, refreshed on the stats thread for at most ``l3.stats_wait_s``
        (a hung backend cannot hold GetStats; see :mod:`hicached.l3.stats_cache`)."""
        if self._l3_stats is None:
            return []
        name, s, _age = await self._l3_stats.current(self.core.config.l3.stats_wait_s)
        if s is None:
            return [pb.BackendInfo(name=name)]  # not refreshed yet
        return [
            pb.BackendInfo(
                name=name,
                pages=s.pages,
                bytes=s.bytes,
                capacity_bytes=s.capacity_bytes,
                hits=s.hits,
                misses=s.misses,
                corrupt_pages=s.corrupt_pages,
            )
        ]

    @unary
    async def Ping(self, request: pb.PingRequest, context: Ctx) -> pb.PingResponse:
        return pb.PingResponse(payload=request.payload)


MAX_TENANT_BYTES = 256


def check_tenant(tenant: str) -> None:
    if len(tenant.encode()) > MAX_TENANT_BYTES or not tenant.isprintable():
        raise InvalidArgument(
            f"identity.tenant {clip(tenant)} must be printable and at most {MAX_TENANT_BYTES} bytes"
        )


def same_tenant(session_tenant: str, given: str, field: str) -> None:
    """A per-call tenant (deprecated) must be empty or the session's own."""
    if given and given != session_tenant:
        raise PermissionDenied(
            f"{field} {clip(given)} is not this session's tenant {clip(session_tenant)}: "
            "a session works only in the tenant it attached with (identity.tenant)"
        )


def worker_view(full: pb.GetStatsResponse, *, own: bool) -> pb.GetStatsResponse:
    """What a non-admin may see: aggregates and group counts; no other session's ids,
    identities or backups, and no segment names. ``own``: the request named one
    session (the caller's), whose entry and backups stay."""
    view = pb.GetStatsResponse()
    view.CopyFrom(full)
    if not own:
        del view.sessions[:]
        del view.backups[:]
    for group in view.groups:
        for pool in group.pools:
            pool.segment = ""
    return view


def stats_out(stats: DaemonStats, backends: list[pb.BackendInfo]) -> pb.GetStatsResponse:
    return pb.GetStatsResponse(
        sessions=[convert.session_info(s) for s in stats.sessions],
        groups=[
            pb.GroupInfo(
                group=g.group_id,
                model_name=g.model_name,
                pools=[convert.pool_info(p) for p in g.pools],
                indexed_pages=g.indexed_pages,
                sessions=g.sessions,
            )
            for g in stats.groups
        ],
        backups=[
            pb.RetractionInfo(
                backup_id=b.backup_id,
                session_id=b.session_id,
                request_id=b.request_id,
                pages=b.pages,
                lease_expires_unix_ms=b.lease_expires_unix_ms,
            )
            for b in stats.backups
        ],
        backends=backends,
        host_budget_bytes=stats.host_budget_bytes,
        host_used_bytes=stats.host_used_bytes,
        draining=stats.draining,
        version=__version__,
    )


class KeyedServicerMixin(_Base):
    """The content-addressed RPCs of HiCacheService (see hicached.core.keyed)."""

    keyed: KeyedCache

    async def keys_of(self, session_id: str, source: tpb.KeySource) -> tuple[list[str], str]:
        """(keys, tenant) of a KeySource; token chains are hashed with the group's page size.

        The tenant is the session's; a KeySource.tenant naming another is PERMISSION_DENIED.
        Counts are checked here (O(1)); copying, hashing and the per-key length checks run
        on the hash lane, never on the event loop.
        """
        kind = source.WhichOneof("source")
        tenant = self.keyed.tenant(session_id)
        same_tenant(tenant, source.tenant, "keys.tenant")
        lim = self.limits
        if kind == "keys":
            check_count("keys in this request", len(source.keys.keys), lim.max_keys_per_request,
                        "limits.max_keys_per_request")  # fmt: skip
            return await self.lanes.hash.run(self._given_keys, source.keys), tenant
        if kind == "tokens":
            chain = source.tokens
            check_count("token ids in keys.tokens", len(chain.token_ids), lim.max_tokens_per_request,
                        "limits.max_tokens_per_request")  # fmt: skip
            page = self.keyed.page_size(session_id)
            check_count("keys in this request", len(chain.token_ids) // page, lim.max_keys_per_request,
                        "limits.max_keys_per_request")  # fmt: skip
            return await self.lanes.hash.run(self._token_keys, chain, page), tenant
        raise InvalidArgument("keys is empty: set keys.keys or keys.tokens")

    def _given_keys(self, keys: tpb.PageKeys) -> list[str]:
        out = list(keys.keys)
        check_keys(out, self.limits)
        return out

    def _given_pages(self, given: Any) -> list[tuple[str, str, bytes]]:
        pages = [(p.key, p.pool, p.data) for p in given]
        check_keys([key for key, _, _ in pages], self.limits)
        return pages

    def _token_keys(self, chain: tpb.TokenChain, page_size: int) -> list[str]:
        # The repeated field itself, not list(...) of it: page_keys slices one page at a time,
        # so no single C call holds the GIL for the whole chain (4 M ids: ~0.2 s of event-loop stall).
        return page_keys(
            chain.token_ids,  # type: ignore[arg-type]
            page_size,
            extra_key=chain.extra_key if chain.HasField("extra_key") else None,
            cache_salt=chain.cache_salt if chain.HasField("cache_salt") else None,
            include_partial=chain.include_partial_page,
        )

    @unary
    async def Lookup(self, request: pb.LookupRequest, context: Ctx) -> pb.LookupResponse:
        keys, _ = await self.keys_of(request.session_id, request.keys)
        run = self.run_l3 if self.has_l3() else self.run  # a lookup asks L3 for what L2 lacks
        result = await run(self.keyed.lookup, request.session_id, keys)
        return pb.LookupResponse(
            keys=keys, l2_hit_pages=result.l2_hit_pages, total_hit_pages=result.total_hit_pages
        )

    @unary
    async def Publish(self, request: pb.PublishRequest, context: Ctx) -> pb.PublishResponse:
        keys, _ = await self.keys_of(request.session_id, request.keys)
        transfers = [convert.transfer_in(t) for t in request.transfers]
        published, existing = await self.run(
            self.keyed.publish, request.session_id, request.op_id, keys, transfers
        )
        return pb.PublishResponse(published_pages=published, existing_pages=existing)

    @unary
    async def PutPages(self, request: pb.PutPagesRequest, context: Ctx) -> pb.PutPagesResponse:
        no_fence(request.ready)
        keys, _ = await self.keys_of(request.session_id, request.keys)
        transfers = convert.batch_in(request.batch, self._anchor(request.session_id))
        r = await self.run(self.keyed.put_pages, request.session_id, request.op_id, keys, transfers)
        return pb.PutPagesResponse(
            ok=r.ok,
            stored_pages=r.stored_pages,
            existing_pages=r.existing_pages,
            acks=convert.acks_out(r.acks),
            reason=r.reason,
        )

    @unary
    async def GetPages(self, request: pb.GetPagesRequest, context: Ctx) -> pb.GetPagesResponse:
        keys, _ = await self.keys_of(request.session_id, request.keys)
        transfers = convert.batch_in(request.batch, self._anchor(request.session_id))
        run = self.run_l3 if request.include_l3 else self.run
        hit, acks = await run(
            self.keyed.get_pages,
            request.session_id,
            request.op_id,
            keys,
            transfers,
            include_l3=request.include_l3,
        )
        return pb.GetPagesResponse(hit_pages=hit, acks=convert.acks_out(acks))

    @unary
    async def Prefetch(self, request: pb.PrefetchRequest, context: Ctx) -> pb.PrefetchResponse:
        keys, _ = await self.keys_of(request.session_id, request.keys)
        policy = PREFETCH_POLICIES.get(request.policy)
        if policy is None:
            raise InvalidArgument(f"policy = {request.policy} is not a PrefetchPolicy")
        pid, planned = await self.run_l3(
            self.keyed.prefetch,
            request.session_id,
            keys,
            policy=policy,
            timeout_ms=request.timeout_ms,
        )
        return pb.PrefetchResponse(prefetch_id=pid, planned_pages=planned)

    @unary
    async def PrefetchStatus(
        self, request: pb.PrefetchStatusRequest, context: Ctx
    ) -> pb.PrefetchStatusResponse:
        status = await self.run_l3(
            self.keyed.prefetch_status,
            request.session_id,
            request.prefetch_id,
            wait=request.wait,
            timeout_s=self.limits.max_wait_s,
        )
        return pb.PrefetchStatusResponse(
            state=PREFETCH_STATES[status.state],
            completed_pages=status.completed_pages,
            planned_pages=status.planned_pages,
        )

    @unary
    async def CancelPrefetch(
        self, request: pb.CancelPrefetchRequest, context: Ctx
    ) -> pb.CancelPrefetchResponse:
        done = await self.run_l3(self.keyed.cancel_prefetch, request.session_id, request.prefetch_id)
        return pb.CancelPrefetchResponse(completed_pages=done)

    @unary
    async def Backup(self, request: pb.BackupRequest, context: Ctx) -> pb.BackupResponse:
        keys, _ = await self.keys_of(request.session_id, request.keys)
        r = await self.run_l3(
            self.keyed.backup, request.session_id, keys, wait=request.wait, timeout_s=self.limits.max_wait_s
        )
        return pb.BackupResponse(queued_pages=r.queued, stored_pages=r.stored)

    @unary
    async def PutBytes(self, request: pb.PutBytesRequest, context: Ctx) -> pb.PutBytesResponse:
        same_tenant(self.keyed.tenant(request.session_id), request.tenant, "tenant")
        check_count("pages in this request", len(request.pages), self.limits.max_keys_per_request,
                    "limits.max_keys_per_request")  # fmt: skip
        pages = await self.lanes.hash.run(self._given_pages, request.pages)
        stored, existing = await self.run(self.keyed.put_bytes, request.session_id, request.op_id, pages)
        return pb.PutBytesResponse(stored_pages=stored, existing_pages=existing)

    @unary
    async def GetBytes(self, request: pb.GetBytesRequest, context: Ctx) -> pb.GetBytesResponse:
        keys, _ = await self.keys_of(request.session_id, request.keys)
        # The answer's size, before building it: every key may hit, each with its pages of every pool.
        check_response(
            f"GetBytes of {len(keys)} keys",
            len(keys) * self.keyed.page_bytes(request.session_id),
            self.limits,
            self.core.config.server.max_message_bytes,
        )
        run = self.run_l3 if request.include_l3 else self.run
        pages = await run(self.keyed.get_bytes, request.session_id, keys, include_l3=request.include_l3)
        hit = len({k for k, _, _ in pages})
        return pb.GetBytesResponse(
            pages=[tpb.PageBytes(key=k, pool=p, data=d) for k, p, d in pages], hit_pages=hit
        )


PREFETCH_POLICIES = {
    pb.PREFETCH_POLICY_UNSPECIFIED: "",
    pb.PREFETCH_POLICY_BEST_EFFORT: "best_effort",
    pb.PREFETCH_POLICY_WAIT_COMPLETE: "wait_complete",
    pb.PREFETCH_POLICY_TIMEOUT: "timeout",
}
PREFETCH_STATES = {
    PrefetchState.RUNNING: pb.PREFETCH_STATE_RUNNING,
    PrefetchState.DONE: pb.PREFETCH_STATE_DONE,
    PrefetchState.CANCELLED: pb.PREFETCH_STATE_CANCELLED,
    PrefetchState.TIMED_OUT: pb.PREFETCH_STATE_TIMED_OUT,
    PrefetchState.FAILED: pb.PREFETCH_STATE_FAILED,
}


class CacheServicer(KeyedServicerMixin, HiCacheServicer):
    """The full hicached.v1.HiCacheService: HiCacheServicer plus the content-addressed RPCs."""

    def __init__(self, core: HiCacheCore, lanes: Lanes, *, keyed: KeyedCache, **kw: Any) -> None:
        super().__init__(core, lanes, **kw)
        self.keyed = keyed


class AdminServicer(_Base, pb_grpc.AdminServiceServicer):
    """hicached.v1.AdminService: admin only (see :mod:`hicached.server.roles`), except a
    worker's ClearNamespace of its own tenant."""

    def __init__(
        self,
        core: HiCacheCore,
        lanes: Lanes,
        *,
        keyed: KeyedCache,
        on_drain: Callable[[], Awaitable[None]] | None = None,
        on_resume: Callable[[], Awaitable[None]] | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(core, lanes, **kw)
        self.keyed = keyed
        self._on_drain = on_drain
        self._on_resume = on_resume

    def require_admin(self, context: Ctx, what: str) -> None:
        self.access.require_admin(context.invocation_metadata(), what)

    @unary
    async def Drain(self, request: pb.DrainRequest, context: Ctx) -> pb.DrainResponse:
        self.require_admin(context, "Drain")
        self.core.set_draining()
        if self._on_drain is not None:
            await self._on_drain()
        flushed = await self.run_l3(
            self.keyed.drain, wait=request.wait_flush, timeout_s=self.limits.max_wait_s
        )
        return pb.DrainResponse(flushed_pages=flushed)

    @unary
    async def Resume(self, request: pb.ResumeRequest, context: Ctx) -> pb.ResumeResponse:
        self.require_admin(context, "Resume")
        was = self.core.resume()
        if self._on_resume is not None:
            await self._on_resume()
        return pb.ResumeResponse(was_draining=was)

    @unary
    async def ClearNamespace(
        self, request: pb.ClearNamespaceRequest, context: Ctx
    ) -> pb.ClearNamespaceResponse:
        model, tenant = request.model_name, request.tenant or None
        if not self.is_admin(context):
            if not request.session_id:
                self.require_admin(context, "ClearNamespace without session_id (any tenant)")
            own = self.core.session_worker(request.session_id)
            same_tenant(own.tenant, request.tenant, "tenant")
            if model and model != own.model_name:
                raise PermissionDenied(
                    f"model_name {clip(model)} is not this session's model {clip(own.model_name)}: "
                    "a worker clears only its own model and tenant"
                )
            model, tenant = own.model_name, own.tenant
        l2, l3 = await self.run_l3(self.keyed.clear, model, tenant)
        return pb.ClearNamespaceResponse(l2_pages=l2, l3_pages=l3)
