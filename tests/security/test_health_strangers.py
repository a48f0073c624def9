"""Health is open to anyone who reaches TCP (probes carry no token), so what a stranger asks it
must cost the daemon nothing it keeps: a name the daemon does not serve is refused at once and
not kept, a name longer than any service name is not even parsed, and Watch streams are capped
per listener. Before (the stock ``grpc_health`` servicer), every Watch kept its request and a
status entry per name while open: 100 streams of 1 MB names grew the daemon by ~400 MiB.

Against a real daemon listening on TCP with a worker token; the stranger sends none.
"""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hicached_client import HiCacheClient

from tests.support.daemon import Daemon, start_daemon
from tests.support.state import proc_bytes

TOKEN = "health-strangers-token"
WORKER_SERVICE = "hicached.v1.HiCacheService"
KNOWN = ("", WORKER_SERVICE, "hicached.v1.AdminService")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
C = grpc.StatusCode
MIB = 1 << 20
# server.max_health_watchers' default.
MAX_WATCHERS = 64
# What 100 refused 1 MB requests may grow the daemon by: gRPC buffers requests that arrive
# faster than the loop refuses them, up to all 100 MB of them on a busy machine (27 MiB on a
# quiet one, 78 MiB beside a CPU hog), and the allocator may keep what it freed. Before the
# fix they grew it by 459 MiB, held while the streams were open.
RSS_BOUND_MIB = 200
STREAMS, PER_CHANNEL = 100, 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _start(tmp: Path) -> tuple[Daemon, str]:
    token_file = tmp / "token"
    token_file.write_text(TOKEN + "\n")
    port = _free_port()
    daemon = start_daemon("--listen", f"127.0.0.1:{port}", "--set", f"server.auth_token_file={token_file}")
    return daemon, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def tcp_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, str]]:
    daemon, tcp = _start(tmp_path_factory.mktemp("token"))
    try:
        yield daemon, tcp
    finally:
        daemon.stop()


def _channel(target: str) -> grpc.Channel:
    """A channel with its own connection (so the streams spread over connections, as a
    stranger's would, and no connection's stream limit queues them)."""
    return grpc.insecure_channel(
        target, options=[("grpc.use_local_subchannel_pool", 1), ("grpc.max_send_message_length", 64 * MIB)]
    )


def _first(call: Iterator[health_pb2.HealthCheckResponse]) -> str:
    """The stream's first answer: a status name, or the code it ended with."""
    try:
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(next(call).status))
    except grpc.RpcError as exc:
        return str(exc.code().name)  # type: ignore[attr-defined]


def test_unknown_and_huge_names_are_refused_at_once_and_not_kept(tcp_daemon: tuple[Daemon, str]) -> None:
    daemon, tcp = tcp_daemon
    before = proc_bytes(daemon.process.pid, "VmRSS") / MIB
    channels = [_channel(tcp) for _ in range(STREAMS // PER_CHANNEL)]
    try:
        calls = [
            health_pb2_grpc.HealthStub(ch).Watch(
                health_pb2.HealthCheckRequest(service=f"{i}-{j}-" + "x" * MIB), timeout=60
            )
            for i, ch in enumerate(channels)
            for j in range(PER_CHANNEL)
        ]
        answers = [_first(call) for call in calls]  # the streams stay open unless the daemon ends them
        grown = proc_bytes(daemon.process.pid, "VmRSS") / MIB - before
        for call in calls:
            call.cancel()
    finally:
        for ch in channels:
            ch.close()
    assert grown < RSS_BOUND_MIB, f"{STREAMS} Watch streams of 1 MB names grew the daemon by {grown:.0f} MiB"
    assert set(answers) == {"NOT_FOUND"}, answers[:3]
    with _channel(tcp) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert info.value.code() == C.NOT_FOUND  # type: ignore[attr-defined]
        assert "'no.such.Service'" in info.value.details()  # type: ignore[attr-defined]
        with pytest.raises(grpc.RpcError) as info:
            stub.Check(health_pb2.HealthCheckRequest(service="x" * MIB), timeout=10)
        assert info.value.code() == C.NOT_FOUND  # type: ignore[attr-defined]
        assert len(info.value.details()) < 200  # type: ignore[attr-defined]
        assert (
            _first(stub.Watch(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10))
            == "NOT_FOUND"
        )
    with HiCacheClient(tcp, token=TOKEN, timeout_s=10) as client:
        assert client.ping(b"still here") == b"still here"


def test_watch_streams_past_the_cap_are_refused_and_the_first_keep_receiving(
    tcp_daemon: tuple[Daemon, str],
) -> None:
    daemon, tcp = tcp_daemon
    channels = [_channel(tcp) for _ in range(3)]
    request = health_pb2.HealthCheckRequest(service=WORKER_SERVICE)
    try:
        calls = [
            health_pb2_grpc.HealthStub(channels[i % 2]).Watch(request, timeout=60)
            for i in range(MAX_WATCHERS)
        ]
        assert {_first(call) for call in calls} == {"SERVING"}
        extra = health_pb2_grpc.HealthStub(channels[2])
        with pytest.raises(grpc.RpcError) as info:
            next(extra.Watch(request, timeout=10))
        assert info.value.code() == C.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
        assert "server.max_health_watchers=64" in info.value.details()  # type: ignore[attr-defined]
        # Check is not counted.
        assert extra.Check(request, timeout=10).status == SERVING

        with HiCacheClient(daemon.admin_target, timeout_s=30) as admin:
            admin.drain(wait_flush=False)
            assert {_first(call) for call in calls} == {"NOT_SERVING"}
            assert admin.resume() is True
            assert {_first(call) for call in calls} == {"SERVING"}

        # A closed stream gives its place back (the daemon notices the cancel soon after).
        calls.pop().cancel()
        deadline = time.monotonic() + 10
        while (got := _first(extra.Watch(request, timeout=10))) == "RESOURCE_EXHAUSTED":
            assert time.monotonic() < deadline, "the cancelled stream's place never came back"
        assert got == "SERVING"
    finally:
        for ch in channels:
            ch.close()


def test_known_names_serve_then_turn_not_serving_on_sigterm(tmp_path: Path) -> None:
    daemon, tcp = _start(tmp_path)
    try:
        with _channel(tcp) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for name in KNOWN:
                assert stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status == SERVING
            watches = [stub.Watch(health_pb2.HealthCheckRequest(service=n), timeout=60) for n in KNOWN]
            assert [_first(w) for w in watches] == ["SERVING"] * len(KNOWN)
            daemon.process.send_signal(signal.SIGTERM)
            assert [_first(w) for w in watches] == ["NOT_SERVING"] * len(KNOWN)
            for w in watches:
                w.cancel()
        assert daemon.process.wait(timeout=30) == 0
    finally:
        daemon.stop()
