"""Who a caller is: the worker and admin roles of each listener.

Each listener (worker socket, admin socket, TCP) gets its own servicer
instances bound to one :class:`Access`, so a handler never guesses from the
peer string:

* the worker socket: every caller is a worker (the socket's file mode and its
  directory decide who can connect);
* the admin socket: every caller is an admin (mode 0600, or 0660 with
  ``server.admin_group``; the kernel checks the permissions);
* TCP: a call must carry ``authorization: Bearer <token>``: the admin token
  makes it an admin, the worker token a worker. Without a worker token
  (mTLS only, or ``server.insecure_tcp``) a TCP caller is a worker unless it
  carries the admin token.
  :class:`TokenInterceptor` applies this to every service but health (probes
  stay open), reflection included.

Immutable; safe from any thread.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from hicached.errors import PermissionDenied, Unauthenticated

__all__ = ["HEALTH_PREFIX", "Access", "TokenInterceptor"]

HEALTH_PREFIX = "/grpc.health.v1.Health/"


def _bearer(metadata: Any) -> str:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            return value
    return ""


def _matches(got: str, token: str | None) -> bool:
    return token is not None and hmac.compare_digest(got.encode(), f"Bearer {token}".encode())


@dataclass(frozen=True)
class Access:
    """The role rules of one listener."""

    admin_socket: str
    admin: bool = False  # the admin socket: every caller is an admin
    tcp: bool = False
    worker_token: str | None = None
    admin_token: str | None = None

    @property
    def tokens_required(self) -> bool:
        """TCP with a worker token: every call carries a token (worker or admin). Without one
        (mTLS or insecure_tcp) a caller without the admin token is a worker."""
        return self.tcp and self.worker_token is not None

    def authenticate(self, metadata: Any) -> None:
        """UNAUTHENTICATED for a TCP call without a configured token (no-op elsewhere)."""
        if not self.tokens_required:
            return
        got = _bearer(metadata)
        if not (_matches(got, self.worker_token) or _matches(got, self.admin_token)):
            raise Unauthenticated("missing or wrong bearer token (metadata 'authorization: Bearer <token>')")

    def is_admin(self, metadata: Any) -> bool:
        if self.admin:
            return True
        return self.tcp and _matches(_bearer(metadata), self.admin_token)

    def require_admin(self, metadata: Any, what: str) -> None:
        """PERMISSION_DENIED naming where the admin role is, unless the caller is an admin."""
        if not self.is_admin(metadata):
            raise PermissionDenied(
                f"{what} needs the admin role: call it on the admin socket {self.admin_socket} "
                "(or over TCP with the admin token, server.admin_token_file)"
            )


def _deny(
    code: grpc.StatusCode, message: str, handler: grpc.RpcMethodHandler[Any, Any]
) -> grpc.RpcMethodHandler[Any, Any]:
    async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(code, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(code, message)

    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(streaming, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)


class TokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Refuses TCP calls without a configured token before any service runs (health excepted)."""

    def __init__(self, access: Access) -> None:
        self._access = access

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method  # type: ignore[attr-defined]
        if handler is None or method.startswith(HEALTH_PREFIX):
            return handler
        try:
            self._access.authenticate(handler_call_details.invocation_metadata)  # type: ignore[attr-defined]
        except Unauthenticated as exc:
            return _deny(grpc.StatusCode.UNAUTHENTICATED, str(exc), handler)
        return handler
