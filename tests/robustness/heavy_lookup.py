"""A hostile client in its own process: attaches byte-only and sends ``rounds`` Lookups of
``tokens`` token ids each, as pre-serialized bytes with the answer left unparsed (so its
own CPU use stays near zero and cannot slow the test's heartbeats), then prints how long
they took. ``python -m tests.robustness.heavy_lookup TARGET TOKENS ROUNDS``"""

from __future__ import annotations

import sys
import time

import grpc
from hicached_client import HiCacheClient
from hicached_client.v1 import hicached_pb2 as pb
from hicached_client.v1 import types_pb2 as tpb

from tests.robustness.loop_support import attach_bytes

LOOKUP = "/hicached.v1.HiCacheService/Lookup"


def main() -> None:
    target, tokens, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    with HiCacheClient(target, timeout_s=120.0) as client:
        session = attach_bytes(client, "m-heavy", lease_ms=60_000)
        chain = tpb.TokenChain(token_ids=[i % 50_000 for i in range(tokens)])
        body = pb.LookupRequest(session_id=session.session_id, keys=tpb.KeySource(tokens=chain))
        payload = body.SerializeToString()
        secret = (("x-hicached-session-secret", session.info.session_secret),)
        with grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 1 << 30)]) as ch:
            call = ch.unary_unary(LOOKUP, request_serializer=None, response_deserializer=None)
            start = time.perf_counter()
            for _ in range(rounds):
                call(payload, metadata=secret, timeout=120)
            print(f"{rounds} lookups of {tokens} tokens: {time.perf_counter() - start:.2f} s", flush=True)
        session.detach()


if __name__ == "__main__":
    main()
