"""What one client can make the daemon hold (docs/limits.md): pool groups, the answers it
leaves unread, the calls it queues on the hash lane, the metric series it names. Each test
runs a real daemon and fails on the code before its bound."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from hicached_client import HiCacheClient, TokenChain
from hicached_client.v1 import hicached_pb2 as pb
from hicached_client.v1 import types_pb2 as tpb

from hicached.index.keys import page_keys
from tests.robustness.loop_support import PAGE, attach_bytes
from tests.support.daemon import Daemon, start_daemon

LOOKUP = "/hicached.v1.HiCacheService/Lookup"


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    d = start_daemon()
    try:
        yield d
    finally:
        d.stop()


def test_a_lookup_of_given_keys_does_not_send_them_back(daemon: Daemon) -> None:
    """Before, Lookup echoed every given key: up to 32 MiB per answer, built and serialized on
    the event loop (a bystander waited ~0.3 s) and held while a client that stopped reading
    let it sit unsent (~160 MiB per call). Keys derived from tokens still come back."""
    with HiCacheClient(daemon.target) as client:
        session = attach_bytes(client, "m-echo", lease_ms=60_000)
        keys = [f"{i:064x}" for i in range(4096)]
        request = pb.LookupRequest(
            session_id=session.session_id, keys=tpb.KeySource(keys=tpb.PageKeys(keys=keys))
        )
        secret = (("x-hicached-session-secret", session.info.session_secret),)
        with grpc.insecure_channel(daemon.target) as channel:
            call = channel.unary_unary(LOOKUP, request_serializer=None, response_deserializer=None)
            raw = call(request.SerializeToString(), metadata=secret, timeout=30)
        answer = pb.LookupResponse.FromString(raw)
        assert list(answer.keys) == [] and len(raw) < 64
        assert session.lookup(keys).keys == tuple(keys)  # the client names them from its request
        tokens = list(range(4 * PAGE))
        assert session.lookup(TokenChain(tokens)).keys == tuple(page_keys(tokens, PAGE))
        session.detach()
