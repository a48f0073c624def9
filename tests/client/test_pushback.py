"""gRPC's own retry honours the daemon's hint (the groundwork for issue 14's item 4 retries).

A channel whose service config retries RESOURCE_EXHAUSTED waits the server's
``grpc-retry-pushback-ms`` (here 250 ms) instead of its own 10 ms backoff, and
resends the same request (same op_id). Fails before the key change: with the
private ``retry-after-ms`` key gRPC ignored the hint, and three attempts took
about 30 ms.
"""

from __future__ import annotations

import json
import time

import grpc
import pytest
from hicached_client.v1 import hicached_pb2 as pb
from hicached_client.v1 import hicached_pb2_grpc as pb_grpc

from tests.client.scripted import RETRY_AFTER_MS, SESSION, ScriptedServer

SERVICE_CONFIG = {
    "methodConfig": [
        {
            "name": [{"service": "hicached.v1.HiCacheService"}],
            "retryPolicy": {
                "maxAttempts": 3,
                "initialBackoff": "0.01s",
                "maxBackoff": "1s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["RESOURCE_EXHAUSTED", "UNAVAILABLE"],
            },
        }
    ]
}


def test_a_service_config_retry_waits_the_pushback_and_keeps_the_op_id(
    scripted_server: ScriptedServer,
) -> None:
    options = [("grpc.service_config", json.dumps(SERVICE_CONFIG)), ("grpc.enable_retries", 1)]
    with grpc.insecure_channel(scripted_server.target, options=options) as channel:
        stub = pb_grpc.HiCacheServiceStub(channel)
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            stub.Alloc(pb.AllocRequest(session_id=SESSION, pool="full", num_pages=4, op_id="op-1"))
        elapsed = time.monotonic() - start
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert scripted_server.servicer.op_ids["Alloc"] == ["op-1"] * 3
    # Two waits of the pushback at least (a lower bound: never flaky on a slow machine).
    assert elapsed >= 2 * RETRY_AFTER_MS / 1000
