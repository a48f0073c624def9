"""Sessions per peer (``limits.max_sessions_per_peer``), checked before an attach starts.

A peer is what the kernel or the transport says, never what the client claims:
the uid of an attach's fd handoff (``SO_PEERCRED``), else the host of a TCP
caller (its port changes per connection), else the Unix socket itself (byte-only
clients on the socket share one count: without a handoff the daemon cannot tell
them apart).

Thread-safety: loop-confined (the servicers call it on the event loop only); one
instance is shared by every listener.
"""

from __future__ import annotations

from collections.abc import Callable

from hicached.core.types import PeerCred
from hicached.errors import LimitExceeded

__all__ = ["PeerSessions", "peer_key"]


def peer_key(cred: PeerCred | None, transport_peer: str) -> str:
    """``uid:1000``, ``tcp:10.0.0.7`` / ``tcp:[::1]``, or ``unix``."""
    if cred is not None:
        return f"uid:{cred.uid}"
    if transport_peer.startswith(("ipv4:", "ipv6:")):
        address = transport_peer.partition(":")[2]
        return "tcp:" + address.rpartition(":")[0]
    return "unix"


class PeerSessions:
    """Live session ids per peer, plus attaches under way (reserved before they start)."""

    def __init__(self, limit: int, alive: Callable[[], frozenset[str]]) -> None:
        self._limit = limit
        self._alive = alive
        self._sessions: dict[str, set[str]] = {}
        self._reserved: dict[str, int] = {}

    def reserve(self, key: str) -> None:
        """Count an attach under way; LimitExceeded when the peer is at its limit."""
        live = self._alive()
        mine = self._sessions.get(key, set()) & live
        for other, ids in list(self._sessions.items()):  # forget ended sessions
            kept = ids & live
            if kept:
                self._sessions[other] = kept
            else:
                del self._sessions[other]
        held = len(mine) + self._reserved.get(key, 0)
        if held >= self._limit:
            raise LimitExceeded(
                f"peer {key} already holds {held} sessions, the most limits.max_sessions_per_peer="
                f"{self._limit} allows: detach sessions it no longer uses",
                "limits.max_sessions_per_peer",
            )
        self._reserved[key] = self._reserved.get(key, 0) + 1

    def settle(self, key: str, session_id: str | None) -> None:
        """The reserved attach finished: as ``session_id``, or failed (None)."""
        left = self._reserved.get(key, 1) - 1
        if left:
            self._reserved[key] = left
        else:
            self._reserved.pop(key, None)
        if session_id is not None:
            self._sessions.setdefault(key, set()).add(session_id)
