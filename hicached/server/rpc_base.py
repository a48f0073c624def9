"""What every servicer shares: its collaborators and where a core call runs.

A servicer method is thin: check O(1) limits -> convert -> ``offload`` the core call
-> build the response. Authentication, the session capability, identifier limits,
error -> status and the RPC metrics are not here but in the interceptors around every
call (:mod:`hicached.server.interceptors`); where each RPC's core call runs (the event
loop or which lane) is the one table :data:`hicached.server.lanes.RPC_LANES`.

The settings a servicer reads are given at construction (:class:`ServicerOptions`, built
by the composition root, ``hicached/daemon.py``), not looked up on the core.

Thread-safety: servicer methods run on the event loop; what they offload runs on a
lane's thread and touches only the (thread-safe) core.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar, cast

import grpc
from hicached_client.v1 import hicached_pb2 as pb
from hicached_client.v1 import types_pb2 as tpb

from hicached.config import LimitsConfig
from hicached.core.service import HiCacheCore
from hicached.core.types import Ack, PoolTransfer
from hicached.errors import PermissionDenied, Unimplemented, clip
from hicached.l3.stats_cache import StatsCache
from hicached.server import convert
from hicached.server.handoff import HandoffRegistry
from hicached.server.lanes import RPC_LANES, Lanes, Where
from hicached.server.limits import check_pool_names
from hicached.server.peers import PeerSessions, UnreadAnswers
from hicached.server.roles import Access

T = TypeVar("T")
logger = logging.getLogger(__name__)
Ctx = grpc.aio.ServicerContext[Any, Any]
LayerCall = Callable[[Callable[[int], None] | None], tuple[Ack, ...]]


@dataclasses.dataclass(frozen=True)
class ServicerOptions:
    """The settings the servicers read (from the configuration; immutable)."""

    limits: LimitsConfig
    max_message_bytes: int  # server.max_message_bytes: bounds every answer
    has_l3: bool  # an L3 backend is configured (l3.backend is not none)
    l3_stats_wait_s: float  # l3.stats_wait_s: GetStats's wait for fresh L3 stats


class ServicerBase:
    """The collaborators of one listener's servicers (bound to its role, ``access``)."""

    def __init__(
        self,
        core: HiCacheCore,
        lanes: Lanes,
        *,
        options: ServicerOptions,
        access: Access,
        handoff: HandoffRegistry | None = None,
        peers: PeerSessions | None = None,
        answers: UnreadAnswers | None = None,
        l3_stats: StatsCache | None = None,
    ) -> None:
        self.core = core
        self.lanes = lanes
        self.options = options
        self.limits: LimitsConfig = options.limits
        self.access = access
        self._handoff = handoff
        self._peers = peers
        self._answers = answers
        self._l3_stats = l3_stats

    def is_admin(self, context: Ctx) -> bool:
        return self.access.is_admin(context.invocation_metadata())

    def require_admin(self, context: Ctx, what: str) -> None:
        self.access.require_admin(context.invocation_metadata(), what)

    def anchor(self, session_id: str) -> str:
        return self.core.anchor_pool(session_id)

    def batch_in(self, batch: tpb.TransferBatch, session_id: str) -> list[PoolTransfer]:
        """A request's batch as the core takes it (:func:`convert.batch_in`, bounded), each
        pool name within ``limits.max_identity_bytes``."""
        out = convert.batch_in(
            batch,
            self.anchor(session_id),
            max_pools=self.limits.max_pools_per_attach,
            max_pages=self.core.config.server.max_batch_pages,
        )
        check_pool_names("transfers", (t.name for t in out), self.limits)
        return out

    def transfers_in(self, transfers: Sequence[tpb.PoolTransfer]) -> list[PoolTransfer]:
        """A request's list of transfers (:func:`convert.transfers_in`, bounded), each pool
        name within ``limits.max_identity_bytes``."""
        out = convert.transfers_in(
            transfers,
            max_pools=self.limits.max_pools_per_attach,
            max_pages=self.core.config.server.max_batch_pages,
        )
        check_pool_names("transfers", (t.name for t in out), self.limits)
        return out

    def hold_answer(self, context: Ctx, session_id: str, nbytes: int, what: str) -> None:
        """Count an answer of up to ``nbytes`` against the peer that attached ``session_id``
        until its call ends (:class:`UnreadAnswers`); ResourceExhausted when the peer holds
        too much that it has not read."""
        answers = self._answers
        if answers is None:
            return
        peer = self.core.session_origin(session_id) or "unix"
        answers.hold(peer, nbytes, what)

        def release(_: object) -> None:
            answers.release(peer, nbytes)

        # grpc-stubs declares the callback a class; gRPC calls any callable with the context.
        context.add_done_callback(cast("grpc.aio.DoneCallback[Any, Any]", release))

    @staticmethod
    def waiting(context: Ctx) -> Callable[[], bool]:
        """Whether the call's client still waits (False once it is cancelled or past its
        deadline); any thread may ask."""
        ended = threading.Event()
        context.add_done_callback(cast("grpc.aio.DoneCallback[Any, Any]", lambda _: ended.set()))
        return lambda: not ended.is_set()

    def has_l3(self) -> bool:
        return self.options.has_l3

    async def offload(
        self,
        rpc: str,
        fn: Callable[..., T],
        *args: Any,
        l3: bool = False,
        session: str = "",
        where: Where | None = None,
        **kwargs: Any,
    ) -> T:
        """Run ``rpc``'s core call where :data:`RPC_LANES` places it (or ``where``, this call's
        own placement): inline on the event loop, or on a lane (awaited). ``l3``: this call
        reaches L3 (a COPY_OR_L3 placement). ``session``: the request's session id (the
        interceptor checked its secret), counted against the lane's per-session limit."""
        lane = self.lanes.lane_for(where or RPC_LANES[rpc], l3=l3)
        if lane is None:
            return fn(*args, **kwargs)
        return await lane.run(fn, *args, session=session, **kwargs)

    async def stream_layers(
        self, rpc: str, layer_progress: bool, call: LayerCall, *, session: str
    ) -> AsyncIterator[pb.LoadProgress]:
        """Run a layer-by-layer copy and stream one message per finished layer, then the acks;
        ``session`` as :meth:`offload` takes it."""
        loop = asyncio.get_running_loop()
        layers: asyncio.Queue[int] = asyncio.Queue()

        def on_layer(layer: int) -> None:  # on the copy engine's thread
            loop.call_soon_threadsafe(layers.put_nowait, layer)

        task = asyncio.ensure_future(
            self.offload(rpc, call, on_layer if layer_progress else None, session=session)
        )
        getter: asyncio.Future[int] | None = None
        try:
            while True:
                getter = asyncio.ensure_future(layers.get())
                done, _ = await asyncio.wait({task, getter}, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    yield pb.LoadProgress(layer=getter.result())
                    continue
                break
            while not layers.empty():
                yield pb.LoadProgress(layer=layers.get_nowait())
            acks = task.result()
            yield pb.LoadProgress(layer=-1, done=True, acks=convert.acks_out(acks))
        finally:
            # A client that leaves mid-stream (its deadline, a cancel) closes this generator at a
            # yield or cancels it at the wait. The copy runs on to its end (the session settles
            # its pages) and nobody reads its outcome: take it here, or asyncio logs an ERROR with
            # a traceback for each such call (and one for the pending getter), which any client
            # could repeat at will.
            if getter is not None:
                getter.cancel()
            if not task.done():
                task.add_done_callback(_outcome)
            elif not task.cancelled():
                task.exception()  # raised above already, or the client left after the copy ended


def _outcome(task: asyncio.Future[Any]) -> None:
    """Take a finished task's outcome, which nobody else will (see ``stream_layers``)."""
    if not task.cancelled() and task.exception() is not None:
        logger.debug("a streamed copy whose client left ended with %r", task.exception())


def no_fence(ready: tpb.Fence) -> None:
    """Ready fences are not wired to the copy engine yet: refuse one rather than copy
    memory the worker may still be writing (a worker synchronises before the call)."""
    if ready.WhichOneof("kind") is not None:
        raise Unimplemented(
            "ready fences (cuda_ipc_event) are not supported yet: synchronise the worker's stream "
            "before Write/RetractBackup/PutPages and send no fence"
        )


def same_tenant(session_tenant: str, given: str, field: str) -> None:
    """A per-call tenant (deprecated) must be empty or the session's own."""
    if given and given != session_tenant:
        raise PermissionDenied(
            f"{field} {clip(given)} is not this session's tenant {clip(session_tenant)}: "
            "a session works only in the tenant it attached with (identity.tenant)"
        )
