"""The daemon's retry hint travels as gRPC's own ``grpc-retry-pushback-ms`` (issue 14).

Fails before the change: the daemon sent the private key ``retry-after-ms``.
(tests/client/test_sync.py and test_async.py check over a real channel that the
client reads this key into ``HiCacheError.retry_after_ms``.)
"""

from __future__ import annotations

from hicached.errors import InvalidArgument, ResourceExhausted
from hicached.server.status import trailing_metadata_for


def test_backpressure_carries_the_grpc_pushback_key() -> None:
    exc = ResourceExhausted("copy queue full", retry_after_ms=7)
    assert trailing_metadata_for(exc) == (("grpc-retry-pushback-ms", "7"),)


def test_errors_without_a_hint_carry_no_metadata() -> None:
    assert trailing_metadata_for(ResourceExhausted("budget")) == ()
    assert trailing_metadata_for(InvalidArgument("bad")) == ()
