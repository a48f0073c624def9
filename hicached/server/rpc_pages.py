"""Index-addressed RPCs of HiCacheService: host pages, the data plane and retraction.

Alloc/Free/ResolveTransfers/ReleaseTransfers (page bookkeeping), Write and Load (copies
between a worker's device pools and host pages), RetractBackup/RetractRestore/
RetractDiscard. Load and RetractRestore stream one message per finished layer.

Thread-safety: as :mod:`hicached.server.rpc_base` (methods on the event loop).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from hicached_client.v1 import hicached_pb2 as pb

from hicached.core.checks import check_page_count
from hicached.core.types import Ack
from hicached.errors import HiCacheError
from hicached.server import convert
from hicached.server.lanes import Where
from hicached.server.limits import check_printable
from hicached.server.rpc_base import Ctx, ServicerBase, no_fence

# An allocation zeroes the pages an earlier owner wrote before handing them out (another
# tenant's KV). Up to this many bytes (~0.1 ms) that runs on the event loop, as the rest of
# page bookkeeping does; a larger one runs on the alloc lane: zeroing a GiB takes ~0.1 s,
# which no other kind of call may wait behind, and there it waits for no copy, L3 call or
# attach (at most limits.max_alloc_calls_per_session of one session: each holds its request).
INLINE_ALLOC_BYTES = 1 << 20


class PageRpcs(ServicerBase):
    """Host pages, Write/Load and retraction."""

    # ---- host pages

    def _allocating(self, session_id: str, pages: int) -> Where | None:
        """Where a call that may allocate ``pages`` host pages in each pool runs (None: as
        placed, on the loop). One over ``server.max_batch_pages`` stays on the loop, where
        the core refuses it at once: it neither waits for the lane nor holds a place there."""
        try:
            _, state = self.core.session_group(session_id)
        except HiCacheError:
            return None  # the core call answers why
        if pages > self.core.config.server.max_batch_pages:
            return None
        return None if pages * state.bytes_per_page <= INLINE_ALLOC_BYTES else Where.ALLOC

    async def Alloc(self, request: pb.AllocRequest, context: Ctx) -> pb.AllocResponse:
        pages = await self.offload(
            "Alloc",
            self.core.alloc,
            request.session_id,
            request.op_id,
            request.pool,
            request.num_pages,
            session=request.session_id,
            where=self._allocating(request.session_id, request.num_pages),
        )
        if pages is None:
            return pb.AllocResponse(ok=False)
        return pb.AllocResponse(ok=True, host_pages=pages.tolist())

    async def Free(self, request: pb.FreeRequest, context: Ctx) -> pb.FreeResponse:
        check_page_count(len(request.host_pages), self.core.config.server.max_batch_pages)
        freed = await self.offload(
            "Free",
            self.core.free,
            request.session_id,
            request.op_id,
            request.pool,
            convert.pages_in(request.host_pages),
            session=request.session_id,
        )
        return pb.FreeResponse(freed_pages=freed)

    async def ResolveTransfers(
        self, request: pb.ResolveTransfersRequest, context: Ctx
    ) -> pb.ResolveTransfersResponse:
        transfers = self.batch_in(request.batch, request.session_id)
        pages = max((0 if t.device_indices is None else len(t.device_indices) for t in transfers), default=0)
        result = await self.offload(
            "ResolveTransfers",
            self.core.resolve,
            request.session_id,
            request.op_id,
            transfers,
            session=request.session_id,
            where=self._allocating(request.session_id, pages),
        )
        return pb.ResolveTransfersResponse(ok=result.ok, batch=convert.batch_out(result.transfers))

    async def ReleaseTransfers(
        self, request: pb.ReleaseTransfersRequest, context: Ctx
    ) -> pb.ReleaseTransfersResponse:
        transfers = self.transfers_in(request.transfers)
        freed = await self.offload(
            "ReleaseTransfers",
            self.core.release,
            request.session_id,
            request.op_id,
            transfers,
            session=request.session_id,
        )
        return pb.ReleaseTransfersResponse(freed_pages=freed)

    # ---- data plane

    async def Write(self, request: pb.WriteRequest, context: Ctx) -> pb.WriteResponse:
        no_fence(request.ready)
        transfers = self.batch_in(request.batch, request.session_id)
        result = await self.offload(
            "Write",
            self.core.write,
            request.session_id,
            request.op_id,
            transfers,
            allocate=request.allocate,
            session=request.session_id,
        )
        return pb.WriteResponse(
            ok=result.ok, batch=convert.batch_out(result.transfers), acks=convert.acks_out(result.acks)
        )

    async def Load(self, request: pb.LoadRequest, context: Ctx) -> AsyncIterator[pb.LoadProgress]:
        def call(on_layer: Callable[[int], None] | None) -> tuple[Ack, ...]:
            transfers = self.batch_in(request.batch, request.session_id)
            return self.core.load(request.session_id, request.op_id, transfers, on_layer=on_layer)

        async for msg in self.stream_layers("Load", request.layer_progress, call, session=request.session_id):
            yield msg

    # ---- retraction

    async def RetractBackup(self, request: pb.RetractBackupRequest, context: Ctx) -> pb.RetractBackupResponse:
        no_fence(request.ready)
        check_printable("request_id", request.request_id)  # `hicached status` lists backups
        transfers = self.batch_in(request.batch, request.session_id)
        result = await self.offload(
            "RetractBackup",
            self.core.retract_backup,
            request.session_id,
            request.op_id,
            request.request_id,
            transfers,
            num_tokens=request.num_tokens,
            lease_ms=request.lease_ms,
            session=request.session_id,
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
            transfers = self.batch_in(request.batch, request.session_id)
            return self.core.retract_restore(
                request.session_id, request.op_id, request.backup_id, transfers, on_layer=on_layer
            )

        async for msg in self.stream_layers(
            "RetractRestore", request.layer_progress, call, session=request.session_id
        ):
            yield msg

    async def RetractDiscard(
        self, request: pb.RetractDiscardRequest, context: Ctx
    ) -> pb.RetractDiscardResponse:
        freed = await self.offload(
            "RetractDiscard",
            self.core.retract_discard,
            request.session_id,
            request.op_id,
            request.backup_id,
            session=request.session_id,
        )
        return pb.RetractDiscardResponse(freed_pages=freed)
