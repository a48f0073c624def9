"""One request of a million empty transfers (2 MiB on the wire; converting each took ~4 us on
the event loop) is refused before its transfers are converted: a precise INVALID_ARGUMENT, and
another session's heartbeats keep answering within its lease. A real daemon over its real
socket; the hostile calls are raw bytes signed with the attacker's own session secret."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf.internal.encoder import TagBytes, _VarintBytes
from hicached_client import HiCacheClient
from hicached_client.v1 import hicached_pb2 as pb
from hicached_client.v1 import types_pb2 as tpb

from tests.robustness.loop_support import attach_bytes
from tests.support.daemon import Daemon, start_daemon

LEASE_MS = 1500
TRANSFERS = 1_000_000
SERVICE = "/hicached.v1.HiCacheService/"


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    d = start_daemon()
    try:
        yield d
    finally:
        d.stop()


def _field(number: int, body: bytes) -> bytes:
    return TagBytes(number, 2) + _VarintBytes(len(body)) + body


def _empty_transfers(number: int) -> bytes:
    """``TRANSFERS`` empty messages in repeated field ``number``: two bytes each on the wire."""
    return (TagBytes(number, 2) + _VarintBytes(0)) * TRANSFERS


def _payloads(session_id: str) -> dict[str, bytes]:
    def head(request: type) -> bytes:
        return bytes(request(session_id=session_id, op_id="op-many").SerializeToString())

    batch_field = tpb.TransferBatch.DESCRIPTOR.fields_by_name["transfers"].number
    batch = _empty_transfers(batch_field)
    keys = tpb.KeySource(keys=tpb.PageKeys(keys=["k"])).SerializeToString()  # field 3 of both
    return {
        "Write": head(pb.WriteRequest) + _field(3, batch),
        "GetPages": head(pb.GetPagesRequest) + _field(3, keys) + _field(4, batch),
        "Publish": head(pb.PublishRequest) + _field(3, keys) + _empty_transfers(4),
        "ReleaseTransfers": head(pb.ReleaseTransfersRequest) + _empty_transfers(3),
    }


def test_a_million_transfers_are_refused_before_conversion_while_others_keep_answering(
    daemon: Daemon,
) -> None:
    """Fails on the code before the bound: each call held the loop ~4 s converting its transfers
    (then NOT_FOUND for the unknown pool, or a refusal naming the first one), and the victim's
    1.5 s lease ran out behind it (its heartbeat NOT_FOUND)."""
    with HiCacheClient(daemon.target, timeout_s=10.0) as client:
        victim = attach_bytes(client, "m-victim", lease_ms=LEASE_MS)
        attacker = attach_bytes(client, "m-attacker")
        payloads = _payloads(attacker.session_id)
        assert all(len(p) > 2 * TRANSFERS for p in payloads.values())
        errors: dict[str, grpc.RpcError] = {}

        def attack() -> None:
            with grpc.insecure_channel(daemon.target) as channel:
                for method, payload in payloads.items():
                    call = channel.unary_unary(
                        SERVICE + method, request_serializer=None, response_deserializer=None
                    )
                    try:
                        call(
                            payload,
                            timeout=30,
                            metadata=[("x-hicached-session-secret", attacker.info.session_secret)],
                        )
                    except grpc.RpcError as exc:
                        errors[method] = exc

        thread = threading.Thread(target=attack)
        latencies: list[float] = []
        thread.start()
        try:
            while thread.is_alive():
                start = time.perf_counter()
                victim.heartbeat()  # NOT_FOUND if its lease ran out behind a stalled loop
                latencies.append(time.perf_counter() - start)
        finally:
            thread.join(timeout=120)
        assert sorted(errors) == sorted(payloads), errors
        for method, exc in errors.items():
            assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT, (method, exc.code(), exc.details())
            assert f"{TRANSFERS} transfers in one request" in (exc.details() or ""), (method, exc.details())
            assert "limits.max_buffers_per_attach=" in (exc.details() or ""), (method, exc.details())
        assert latencies and max(latencies) < LEASE_MS / 1000, max(latencies, default=None)
        victim.heartbeat()
        attacker.heartbeat()
        attacker.detach()
        victim.detach()
