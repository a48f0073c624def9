"""Session and observability RPCs of HiCacheService: Attach, Detach, Heartbeat, GetStats, Ping.

Thread-safety: as :mod:`hicached.server.rpc_base` (methods on the event loop).
"""

from __future__ import annotations

import contextlib
import os

from hicached_client.v1 import hicached_pb2 as pb

from hicached import __version__
from hicached.core.stats import DaemonStats
from hicached.core.types import PeerCred
from hicached.errors import FailedPrecondition, InvalidArgument, PermissionDenied, clip
from hicached.server import convert
from hicached.server.limits import check_buffers, check_identity
from hicached.server.peers import Buffers, peer_key
from hicached.server.rpc_base import Ctx, ServicerBase
from hicached.transfer.handles import FdBufferHandle
from hicached.transfer.mappings import fd_span_count

MAX_TENANT_BYTES = 256


class SessionRpcs(ServicerBase):
    """Attach (with its fd handoff and per-peer session limit), Detach, Heartbeat, GetStats, Ping."""

    async def Attach(self, request: pb.AttachRequest, context: Ctx) -> pb.AttachResponse:
        peer, fds = self._take_handoff(request.handoff_ticket, context)
        try:
            check_identity(request.identity, self.limits)
            check_buffers(request.pools, self.limits)
            worker = convert.worker_id(request.identity)
            check_tenant(worker.tenant)
            pools = [convert.pool_request(p, i, fds) for i, p in enumerate(request.pools)]
            key = peer_key(peer, context.peer())
            # Handed-over memfds, as declared (each buffer's size must match its shape, checked at
            # the mapping): the daemon maps their span. CUDA buffers map device memory instead.
            fd_buffers = [
                b.handle
                for p in pools
                for b in p.k_buffers + p.v_buffers
                if isinstance(b.handle, FdBufferHandle)
            ]
            buffers = Buffers(
                sum(max(h.size, 0) for h in fd_buffers),
                fd_span_count([(h.fd, h.offset, h.size) for h in fd_buffers]),
            )
            if self._peers is not None:
                self._peers.reserve(key, buffers)
            session_id = None
            try:
                result = await self.offload(
                    "Attach",
                    self.core.attach,
                    worker,
                    pools,
                    lease_ms=request.lease_ms,
                    peer=peer,
                    origin=key,
                    join_only=request.join_only,
                )
                session_id = result.session_id
            finally:
                if self._peers is not None:
                    self._peers.settle(key, session_id, buffers)
        finally:
            # Mapped buffers keep their memory and hold no descriptor (hicached.shm.map_file).
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
            group=result.group,
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

    async def Detach(self, request: pb.DetachRequest, context: Ctx) -> pb.DetachResponse:
        freed = await self.offload(
            "Detach", self.core.detach, request.session_id, request.op_id, session=request.session_id
        )
        return pb.DetachResponse(freed_pages=freed)

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Ctx) -> pb.HeartbeatResponse:
        expires = await self.offload(
            "Heartbeat", self.core.heartbeat, request.session_id, session=request.session_id
        )
        return pb.HeartbeatResponse(lease_expires_unix_ms=expires)

    async def GetStats(self, request: pb.GetStatsRequest, context: Ctx) -> pb.GetStatsResponse:
        admin = self.is_admin(context)
        stats = await self.offload(
            "GetStats", self.core.stats, request.session_id, own=not admin, session=request.session_id
        )
        backends = await self.backend_infos()
        if admin:
            return stats_out(stats, backends)
        # A session named here passed the interceptor's secret check: it is the caller's.
        return worker_view(stats_out(stats, backends), own=bool(request.session_id))

    async def backend_infos(self) -> list[pb.BackendInfo]:
        """L3 backend stats, refreshed on the stats thread for at most ``l3.stats_wait_s``
        (a hung backend cannot hold GetStats; see :mod:`hicached.l3.stats_cache`)."""
        if self._l3_stats is None:
            return []
        name, s, age_s, error = await self._l3_stats.current(self.options.l3_stats_wait_s)
        if s is None or age_s is None:
            return [pb.BackendInfo(name=name, error=error)]  # no refresh succeeded yet
        return [
            pb.BackendInfo(
                name=name,
                age_ms=int(age_s * 1000),
                error=error,
                pages=s.pages,
                bytes=s.bytes,
                capacity_bytes=s.capacity_bytes,
                hits=s.hits,
                misses=s.misses,
                corrupt_pages=s.corrupt_pages,
            )
        ]

    async def Ping(self, request: pb.PingRequest, context: Ctx) -> pb.PingResponse:
        return pb.PingResponse(payload=request.payload)


def check_tenant(tenant: str) -> None:
    """At most MAX_TENANT_BYTES, whatever ``limits.max_identity_bytes`` allows (that it is
    printable, :func:`~hicached.server.limits.check_identity` checked with the other names)."""
    if len(tenant.encode()) > MAX_TENANT_BYTES:
        raise InvalidArgument(f"identity.tenant {clip(tenant)} must be at most {MAX_TENANT_BYTES} bytes")


def worker_view(full: pb.GetStatsResponse, *, own: bool) -> pb.GetStatsResponse:
    """What a non-admin may see: the daemon's aggregates; no session, backup or pool group
    of anyone else, and no segment names. ``own``: the request named one session (the
    caller's; ``full`` then holds only it, its group and its backups), which stay. Its group
    is shared by every session of its model and pool layout: the group's counts (indexed
    pages, sessions) are the caller's tenant's (``core.stats(own=True)``), its pools' free
    pages everyone's (the room a write will find)."""
    view = pb.GetStatsResponse()
    view.CopyFrom(full)
    if not own:
        # Groups too: their model names, indexed pages and session counts are other
        # tenants' business (a stranger saw a 'team-b-secret-model' and its cache activity).
        del view.sessions[:]
        del view.backups[:]
        del view.groups[:]
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
                holds=g.holds,
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
