"""Tenants reserved for client uids (``sessions.tenant_uids``).

A session's tenant is what its Attach names (``WorkerIdentity.tenant``); keys are scoped by it,
so tenants cannot see each other's pages. On a node shared by several users that is not enough
by itself: any client could name another user's tenant. A tenant listed here is reserved for
its uids, as the kernel reports them at the attach's fd handoff (SO_PEERCRED); an attach from
any other uid, or without a handoff (TCP, a client that bypasses the library), is
PERMISSION_DENIED. Tenants not listed stay open to every worker, as before. uid 0 may use any
tenant: it can read the host pools' shared memory directly anyway.

Pure data after construction; thread-safe.
"""

from __future__ import annotations

from collections.abc import Mapping

from hicached.core.types import PeerCred
from hicached.errors import PermissionDenied, clip

KEY = "sessions.tenant_uids"


class TenantUids:
    """Which uids may attach as each reserved tenant."""

    def __init__(self, reserved: Mapping[str, frozenset[int]]) -> None:
        """``reserved``: tenant -> its uids, as ``sessions.tenant_uids`` holds them."""
        self._reserved = dict(reserved)

    def check(self, tenant: str, peer: PeerCred | None) -> None:
        """PermissionDenied unless ``tenant`` is open or ``peer`` is one of its uids (or root)."""
        allowed = self._reserved.get(tenant)
        if allowed is None:
            return
        if peer is None:
            raise PermissionDenied(
                f"tenant {clip(tenant)} is reserved for some uids ({KEY}); attach over the Unix socket "
                "with the client library, whose fd handoff tells the daemon your uid"
            )
        if peer.uid != 0 and peer.uid not in allowed:
            raise PermissionDenied(
                f"tenant {clip(tenant)} is reserved for other uids ({KEY}); not uid {peer.uid}"
            )
