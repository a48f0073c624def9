"""The server's observation seam: :class:`RpcObserver`, no-op by default.

One finished call, over gRPC (the metrics interceptor) or the fast lane, is reported once
with its method name, status code and duration. Thread-safety: called on the event loop
and on lane threads, never under a server lock; an observer must be thread-safe, must not
block and must not raise. The Prometheus adapter is :class:`hicached.observability.RpcMetrics`.
"""

from __future__ import annotations

from typing import Protocol

import grpc

__all__ = ["NullRpcObserver", "RpcObserver"]


class RpcObserver(Protocol):
    """What the server reports: each finished RPC."""

    def on_rpc(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        """``method`` (the proto method name) ended with ``code`` after ``seconds``."""


class NullRpcObserver:
    """The default: observes nothing."""

    def on_rpc(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        pass
