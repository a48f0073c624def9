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
  ``interceptors.TokenInterceptor`` applies this to every service but health
  (probes stay open), reflection included.

Immutable; safe from any thread.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any

from hicached.errors import PermissionDenied, Unauthenticated

__all__ = ["HEALTH_PREFIX", "Access"]

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
        if self.is_admin(metadata):
            return
        if self.tcp:
            # A TCP caller may be off the node: the admin socket's path is no use to it and tells
            # a token holder where the node keeps its admin access.
            raise PermissionDenied(
                f"{what} needs the admin role: over TCP, call it with the admin token "
                "(server.admin_token_file), or on the node's admin socket (server.admin_socket)"
            )
        raise PermissionDenied(
            f"{what} needs the admin role: call it on the admin socket {self.admin_socket} "
            "(or over TCP with the admin token, server.admin_token_file)"
        )
