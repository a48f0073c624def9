"""Tenants reserved for client uids (``sessions.tenant_uids``).

A session's tenant is what its Attach names (``WorkerIdentity.tenant``); keys are scoped by it,
so tenants cannot see each other's pages. On a node shared by several users that is not enough
by itself: any client could name another user's tenant. A tenant listed here is reserved for
its uids, as the kernel reports them at the attach's fd handoff (SO_PEERCRED); an attach from
any other uid, or without a handoff (TCP, a client that bypasses the library), is
PERMISSION_DENIED. Tenants not listed stay open to every worker, as before. uid 0 may use any
tenant: it can read the host pools' shared memory directly anyway.

The index sees tenant-scoped keys (:func:`scoped_keys`): a client key ``k`` of tenant ``t`` is
``k~<tag(t)>`` inside the daemon (``k`` itself for the default tenant ``""``), and client keys
may not contain ``~``, so two tenants' keys never meet in L2 or L3 even when a client names
another tenant's raw key, and a page fetched back from L3 can only land in its own tenant.
The tag is public (a SHA-256 of the name) unless the daemon has ``l3.auth_key_file``: then it
is an HMAC of the name under a key derived from that secret
(:class:`~hicached.l3.framing.L3Key`), so another writer of a shared L3 cannot compute a
tenant's object names (and pre-seed them).

Pure functions and data after construction; thread-safe.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence

from hicached.core.types import PeerCred
from hicached.errors import InvalidArgument, PermissionDenied, clip

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


TENANT_SEP = "~"


def tenant_tag(tenant: str, key: bytes | None = None) -> str:
    """A fixed-length, collision-resistant tag of a tenant name (no '/' nor '~'): keyed by
    ``key`` (:attr:`L3Key.tenant_key <hicached.l3.framing.L3Key>`), or public without one."""
    name = b"hicached-tenant\0" + tenant.encode("utf-8")
    if key is None:
        return hashlib.sha256(name).hexdigest()[:32]
    return hmac.new(key, name, "sha256").hexdigest()[:32]


def scoped_keys(tenant: str, keys: Sequence[str], *, tag_key: bytes | None = None) -> list[str]:
    """Client keys -> the index's keys of ``tenant`` (unchanged for the default tenant), its
    tag keyed by ``tag_key`` (see :func:`tenant_tag`).

    InvalidArgument for a key holding the reserved separator ``~``, so no client
    key of one tenant can spell another tenant's scoped key.
    """
    if isinstance(keys, str):
        raise InvalidArgument(f"keys must be a sequence of str, got the single str {keys[:64]!r}")
    out = list(keys)
    try:  # all at once first; one by one to name the key (or when some are not str)
        suspect = TENANT_SEP in "".join(out)
    except TypeError:
        suspect = True
    for key in out if suspect else ():
        if isinstance(key, str) and TENANT_SEP in key:
            raise InvalidArgument(f"content key {clip(key)} contains {TENANT_SEP!r}, which is reserved")
    if not tenant:
        return out
    suffix = TENANT_SEP + tenant_tag(tenant, tag_key)
    return [k + suffix if isinstance(k, str) else k for k in out]


def client_key(key: str) -> str:
    """The client's key of an index key (drops the tenant scope)."""
    return key.partition(TENANT_SEP)[0]
