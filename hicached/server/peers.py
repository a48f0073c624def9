"""What one peer may hold: sessions and the device buffers they hand over
(``limits.max_sessions_per_peer``, ``limits.max_buffer_bytes_per_peer``, checked before an
attach starts) and answers its clients have not read (``limits.max_unread_answer_bytes_per_peer``).

A peer is what the kernel or the transport says, never what the client claims:
the uid of an attach's fd handoff (``SO_PEERCRED``), else the host of a TCP
caller (its port changes per connection), else the Unix socket itself (byte-only
clients on the socket share one count: without a handoff the daemon cannot tell
them apart).

Thread-safety: loop-confined (the servicers, and gRPC's done callbacks, call them on the
event loop only); one instance of each is shared by every listener.
"""

from __future__ import annotations

from collections.abc import Callable

from hicached.core.types import PeerCred
from hicached.errors import LimitExceeded, ResourceExhausted

__all__ = ["PeerSessions", "UnreadAnswers", "peer_key"]


def peer_key(cred: PeerCred | None, transport_peer: str) -> str:
    """``uid:1000``, ``tcp:10.0.0.7`` / ``tcp:[::1]``, or ``unix``."""
    if cred is not None:
        return f"uid:{cred.uid}"
    if transport_peer.startswith(("ipv4:", "ipv6:")):
        address = transport_peer.partition(":")[2]
        return "tcp:" + address.rpartition(":")[0]
    return "unix"


class PeerSessions:
    """Live sessions per peer, each with the bytes of device buffers it handed over, plus
    attaches under way (reserved, with their bytes, before they start).

    Why bytes: an fd's buffers are mapped over the span they declare (a sparse memfd
    makes any size free to the client), so without a bound a peer's sessions could take
    the daemon's whole address space, after which every client's mmap fails.
    """

    def __init__(self, limit: int, byte_limit: int, alive: Callable[[], frozenset[str]]) -> None:
        self._limit = limit
        self._byte_limit = byte_limit
        self._alive = alive
        self._sessions: dict[str, dict[str, int]] = {}  # peer -> session id -> buffer bytes
        self._reserved: dict[str, list[int]] = {}  # peer -> buffer bytes of attaches under way

    def reserve(self, key: str, buffer_bytes: int = 0) -> None:
        """Count an attach under way that hands over ``buffer_bytes`` of device buffers;
        LimitExceeded when the peer is at its session or byte limit (nothing counted then)."""
        live = self._alive()
        for other, sessions in list(self._sessions.items()):  # forget ended sessions
            kept = {sid: n for sid, n in sessions.items() if sid in live}
            if kept:
                self._sessions[other] = kept
            else:
                del self._sessions[other]
        mine = self._sessions.get(key, {})
        reserved = self._reserved.get(key, [])
        held = len(mine) + len(reserved)
        if held >= self._limit:
            raise LimitExceeded(
                f"peer {key} already holds {held} sessions, the most limits.max_sessions_per_peer="
                f"{self._limit} allows: detach sessions it no longer uses",
                "limits.max_sessions_per_peer",
            )
        held_bytes = sum(mine.values()) + sum(reserved)
        if held_bytes + buffer_bytes > self._byte_limit:
            raise LimitExceeded(
                f"this attach hands over {buffer_bytes} bytes of device buffers and peer {key}'s "
                f"sessions already hold {held_bytes}: over limits.max_buffer_bytes_per_peer="
                f"{self._byte_limit}; detach sessions it no longer uses, or declare buffers of the "
                "size the pools use",
                "limits.max_buffer_bytes_per_peer",
            )
        self._reserved.setdefault(key, []).append(buffer_bytes)

    def settle(self, key: str, session_id: str | None, buffer_bytes: int = 0) -> None:
        """The attach reserved with ``buffer_bytes`` finished: as ``session_id``, or failed (None)."""
        reserved = self._reserved.get(key, [])
        if buffer_bytes in reserved:
            reserved.remove(buffer_bytes)
        if not reserved:
            self._reserved.pop(key, None)
        if session_id is not None:
            self._sessions.setdefault(key, {})[session_id] = buffer_bytes


class UnreadAnswers:
    """Bytes of large answers each peer's calls hold until the peer has read them.

    gRPC keeps an answer the peer does not read (its flow-control window closed) until the
    peer reads it or the connection is dropped (``server.keepalive_s``); the call's done
    callback runs only then, so bytes held from the answer's reservation to that callback
    bound what a peer that stops reading can make the daemon hold. One peer's reservations
    never refuse another's.
    """

    # When a refused client may ask again: held answers go as its clients read them.
    RETRY_AFTER_MS = 1000

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._held: dict[str, int] = {}

    def hold(self, key: str, nbytes: int, what: str) -> None:
        """Reserve ``nbytes`` of answer for peer ``key``; ResourceExhausted (with a retry hint)
        when that would take it past the limit. A peer holding nothing is always admitted (the
        answer's own size is bounded by ``limits.max_response_bytes``)."""
        held = self._held.get(key, 0)
        if held and held + nbytes > self._limit:
            raise ResourceExhausted(
                f"{what}: peer {key} holds {held} bytes of answers it has not read yet; {nbytes} more "
                f"exceed limits.max_unread_answer_bytes_per_peer={self._limit}: read the answers of "
                "calls in flight (or cancel them) first",
                retry_after_ms=self.RETRY_AFTER_MS,
            )
        self._held[key] = held + nbytes

    def release(self, key: str, nbytes: int) -> None:
        """The answer of a reservation was read, or its call ended without one."""
        left = self._held.get(key, 0) - nbytes
        if left > 0:
            self._held[key] = left
        else:
            self._held.pop(key, None)
