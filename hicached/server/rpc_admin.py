"""hicached.v1.AdminService: Drain, Resume, ClearNamespace.

Admin only (see :mod:`hicached.server.roles`), except a worker's ClearNamespace of its
own model and tenant. Thread-safety: as :mod:`hicached.server.rpc_base`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from hicached_client.v1 import hicached_pb2 as pb
from hicached_client.v1 import hicached_pb2_grpc as pb_grpc

from hicached.core.keyed import KeyedCache
from hicached.core.service import HiCacheCore
from hicached.errors import PermissionDenied, clip
from hicached.server.lanes import Lanes
from hicached.server.rpc_base import Ctx, ServicerBase, same_tenant


class AdminServicer(ServicerBase, pb_grpc.AdminServiceServicer):
    """hicached.v1.AdminService; ``on_drain``/``on_resume`` flip the listeners' readiness."""

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

    async def Drain(self, request: pb.DrainRequest, context: Ctx) -> pb.DrainResponse:
        self.require_admin(context, "Drain")
        self.core.set_draining()
        if self._on_drain is not None:
            await self._on_drain()
        if not request.wait_flush:
            # Drained now: nothing to wait for, so no place on the L3 lane either (behind a hung
            # L3, the queue refused the call and the operator read a drain that had happened as
            # failed).
            return pb.DrainResponse(flushed_pages=0)
        flushed = await self.offload("Drain", self.keyed.flush, self.limits.max_wait_s)
        return pb.DrainResponse(flushed_pages=flushed)

    async def Resume(self, request: pb.ResumeRequest, context: Ctx) -> pb.ResumeResponse:
        self.require_admin(context, "Resume")
        was = await self.offload("Resume", self.core.resume)
        if self._on_resume is not None:
            await self._on_resume()
        return pb.ResumeResponse(was_draining=was)

    async def ClearNamespace(
        self, request: pb.ClearNamespaceRequest, context: Ctx
    ) -> pb.ClearNamespaceResponse:
        model, tenant = request.model_name, request.tenant or None
        session = ""  # an admin's clear is not counted against a session's L3 calls
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
            model, tenant, session = own.model_name, own.tenant, request.session_id
        l2, l3 = await self.offload("ClearNamespace", self.keyed.clear, model, tenant, session=session)
        return pb.ClearNamespaceResponse(l2_pages=l2, l3_pages=l3)
