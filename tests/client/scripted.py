"""A real gRPC server with a small scripted servicer, on a temporary Unix socket.

The servicer implements a handful of RPCs whose answers the tests choose
(status codes, trailing metadata, stream failures) and records what the client
sent (op_ids, metadata, requests), so the tests observe the client's real
behaviour over a real channel.
"""

from __future__ import annotations

import shutil
import threading
from collections import defaultdict
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from hicached_client.v1 import hicached_pb2 as pb
from hicached_client.v1 import hicached_pb2_grpc as pb_grpc
from hicached_client.v1 import types_pb2 as tpb

from hicached.testing.daemon import scratch_dir

SESSION = "sess-1"
GONE_SESSION = "sess-gone"
RETRY_AFTER_MS = 250


@dataclass
class Script:
    """What the servicer does; tests set fields before calling."""

    # Fail this many calls per RPC name with UNAVAILABLE before answering.
    fail_first: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # Load: fail with this code after sending this many layers (None = never).
    load_fail_after: int | None = None
    num_layers: int = 3


class ScriptedServicer(pb_grpc.HiCacheServiceServicer, pb_grpc.AdminServiceServicer):
    def __init__(self) -> None:
        self.script = Script()
        self.lock = threading.Lock()
        self.op_ids: dict[str, list[str]] = defaultdict(list)
        self.requests: dict[str, list[Any]] = defaultdict(list)
        self.metadata: list[dict[str, str]] = []
        self.heartbeats = 0
        self.heartbeat_event = threading.Event()
        self.heartbeat_target = 3
        # Alloc of pool "hold" and Load of a transfer of pool "hold" enter (set ``entered``) and
        # wait for ``released`` before answering: a call under way for as long as a test needs.
        self.entered = threading.Event()
        self.released = threading.Event()

    def _record(self, name: str, request: Any, context: grpc.ServicerContext) -> None:
        with self.lock:
            self.requests[name].append(request)
            op_id = getattr(request, "op_id", None)
            if op_id is not None:
                self.op_ids[name].append(op_id)
            self.metadata.append({k: str(v) for k, v in context.invocation_metadata()})
            failing = self.script.fail_first[name] > 0
            if failing:
                self.script.fail_first[name] -= 1
        if failing:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{name}: scripted transient failure")

    # ---- sessions
    def Attach(self, request: pb.AttachRequest, context: grpc.ServicerContext) -> pb.AttachResponse:
        self._record("Attach", request, context)
        pools = [
            tpb.PoolInfo(
                name=p.name,
                role=p.role,
                host_layout=p.host_layout,
                page_size=p.page_size,
                total_pages=64,
                free_pages=64,
                page_bytes=4096,
                segment=f"seg-{p.name}",
            )
            for p in request.pools
        ]
        return pb.AttachResponse(session_id=SESSION, lease_ms=request.lease_ms or 600, pools=pools)

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        self._record("Heartbeat", request, context)
        if request.session_id == GONE_SESSION:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown session {request.session_id!r}")
        with self.lock:
            self.heartbeats += 1
            if self.heartbeats >= self.heartbeat_target:
                self.heartbeat_event.set()
        return pb.HeartbeatResponse(lease_expires_unix_ms=1_000 + self.heartbeats)

    def Detach(self, request: pb.DetachRequest, context: grpc.ServicerContext) -> pb.DetachResponse:
        self._record("Detach", request, context)
        return pb.DetachResponse(freed_pages=3)

    # ---- host pages
    def Alloc(self, request: pb.AllocRequest, context: grpc.ServicerContext) -> pb.AllocResponse:
        self._record("Alloc", request, context)
        if request.pool == "full":
            context.set_trailing_metadata((("grpc-retry-pushback-ms", str(RETRY_AFTER_MS)),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "host budget exhausted: 0 of 64 pages free")
        if request.pool == "hold":
            self._hold()
        if request.num_pages > 64:
            return pb.AllocResponse(ok=False)
        return pb.AllocResponse(ok=True, host_pages=list(range(request.num_pages)))

    def Free(self, request: pb.FreeRequest, context: grpc.ServicerContext) -> pb.FreeResponse:
        self._record("Free", request, context)
        seen: set[int] = set()
        for page in request.host_pages:
            if page in seen:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"duplicate host page {page} in pool {request.pool!r}"
                )
            seen.add(page)
        return pb.FreeResponse(freed_pages=len(request.host_pages))

    # ---- data plane
    def Write(self, request: pb.WriteRequest, context: grpc.ServicerContext) -> pb.WriteResponse:
        self._record("Write", request, context)
        batch = tpb.TransferBatch()
        batch.CopyFrom(request.batch)
        acks = []
        for t in batch.transfers:
            if not t.host_pages:
                t.host_pages.extend(p + 100 for p in t.device_pages)
                t.host_allocated = True
            acks.append(
                tpb.PoolAck(
                    pool=t.pool,
                    pages=len(t.device_pages),
                    tokens=16 * len(t.device_pages),
                    bytes=4096 * len(t.device_pages),
                )
            )
        return pb.WriteResponse(ok=True, batch=batch, acks=acks)

    def Load(self, request: pb.LoadRequest, context: grpc.ServicerContext) -> Iterator[pb.LoadProgress]:
        self._record("Load", request, context)
        yield from self._progress(request.batch, request.layer_progress, context)

    def RetractRestore(
        self, request: pb.RetractRestoreRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.LoadProgress]:
        self._record("RetractRestore", request, context)
        yield from self._progress(request.batch, request.layer_progress, context)

    def _hold(self) -> None:
        self.entered.set()
        self.released.wait(timeout=30)

    def _progress(
        self, batch: tpb.TransferBatch, layer_progress: bool, context: grpc.ServicerContext
    ) -> Iterator[pb.LoadProgress]:
        if any(t.pool == "hold" for t in batch.transfers):
            self._hold()
        for layer in range(self.script.num_layers):
            if self.script.load_fail_after == layer:
                context.abort(grpc.StatusCode.DATA_LOSS, f"layer {layer}: scripted failure")
            if layer_progress:
                yield pb.LoadProgress(layer=layer)
        acks = [tpb.PoolAck(pool=t.pool, pages=len(t.device_pages)) for t in batch.transfers]
        yield pb.LoadProgress(layer=self.script.num_layers - 1, done=True, acks=acks)

    # ---- observability
    def GetStats(self, request: pb.GetStatsRequest, context: grpc.ServicerContext) -> pb.GetStatsResponse:
        self._record("GetStats", request, context)
        pool = tpb.PoolInfo(
            name="kv",
            role=tpb.POOL_ROLE_ANCHOR,
            host_layout=tpb.HOST_LAYOUT_PAGE_FIRST,
            total_pages=64,
            free_pages=60,
        )
        return pb.GetStatsResponse(
            sessions=[
                pb.SessionInfo(
                    session_id=SESSION,
                    identity=tpb.WorkerIdentity(instance_id="w", tp_size=2),
                    group="g1",
                    owned_pages=4,
                )
            ],
            groups=[pb.GroupInfo(group="g1", model_name="m", pools=[pool], sessions=1)],
            host_budget_bytes=1 << 20,
            host_used_bytes=4096,
            version="test",
        )

    def Ping(self, request: pb.PingRequest, context: grpc.ServicerContext) -> pb.PingResponse:
        self._record("Ping", request, context)
        return pb.PingResponse(payload=request.payload)

    def Drain(self, request: pb.DrainRequest, context: grpc.ServicerContext) -> pb.DrainResponse:
        self._record("Drain", request, context)
        return pb.DrainResponse(flushed_pages=7 if request.wait_flush else 0)


@dataclass
class ScriptedServer:
    target: str
    servicer: ScriptedServicer


@pytest.fixture
def scripted_server() -> Iterator[ScriptedServer]:
    # A short path (AF_UNIX paths are limited to ~107 bytes) in a directory of this uid: the
    # client refuses a socket in one others can write, as /tmp.
    base = scratch_dir("hcc")
    sock = base / "hicached.sock"
    servicer = ScriptedServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_HiCacheServiceServicer_to_server(servicer, server)
    pb_grpc.add_AdminServiceServicer_to_server(servicer, server)
    target = f"unix://{sock}"
    assert server.add_insecure_port(target) == 1
    server.start()
    try:
        yield ScriptedServer(target=target, servicer=servicer)
    finally:
        server.stop(grace=None).wait()
        shutil.rmtree(base, ignore_errors=True)
