"""What one peer may hold: sessions and the device buffers they hand over
(``limits.max_sessions_per_peer``, ``limits.max_buffer_bytes_per_peer``,
``limits.max_mappings_per_peer``, checked before an attach starts), requests its calls
hold (``limits.max_request_bytes_held_per_peer``) and answers its clients have not read
(``limits.max_unread_answer_bytes_per_peer``).

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
from dataclasses import dataclass

from hicached.core.types import PeerCred
from hicached.errors import LimitExceeded, ResourceExhausted

__all__ = ["Buffers", "HeldRequests", "PeerSessions", "UnreadAnswers", "peer_key"]


def peer_key(cred: PeerCred | None, transport_peer: str) -> str:
    """``uid:1000``, ``tcp:10.0.0.7`` / ``tcp:[::1]``, or ``unix``."""
    if cred is not None:
        return f"uid:{cred.uid}"
    if transport_peer.startswith(("ipv4:", "ipv6:")):
        address = transport_peer.partition(":")[2]
        return "tcp:" + address.rpartition(":")[0]
    return "unix"


@dataclass(frozen=True)
class Buffers:
    """What one attach's memfd device buffers cost the daemon: the bytes they declare (it maps
    their span) and the mappings it makes of them (:func:`hicached.transfer.mappings.fd_span_count`)."""

    nbytes: int = 0
    mappings: int = 0


class PeerSessions:
    """Live sessions per peer, each with the device buffers it handed over, plus attaches
    under way (reserved, with their buffers, before they start).

    Why bytes: an fd's buffers are mapped over the span they declare (a sparse memfd
    makes any size free to the client), so without a bound a peer's sessions could take
    the daemon's whole address space, after which every client's mmap fails. Why mappings:
    buffers far apart in a memfd are mapped apart, and the kernel allows a process 65,530
    mappings (``vm.max_map_count``) in all: past them every mmap of the daemon fails (thread
    stacks, allocations, pools).
    """

    def __init__(
        self, limit: int, byte_limit: int, alive: Callable[[], frozenset[str]], *, mapping_limit: int
    ) -> None:
        self._limit = limit
        self._byte_limit = byte_limit
        self._mapping_limit = mapping_limit
        self._alive = alive
        self._sessions: dict[str, dict[str, Buffers]] = {}  # peer -> session id -> its buffers
        self._reserved: dict[str, list[Buffers]] = {}  # peer -> buffers of attaches under way

    def reserve(self, key: str, buffers: Buffers = Buffers()) -> None:
        """Count an attach under way that hands over ``buffers``; LimitExceeded when the peer
        is at its session, byte or mapping limit (nothing counted then)."""
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
        holding = [*mine.values(), *reserved]
        held_bytes = sum(b.nbytes for b in holding)
        buffer_bytes = buffers.nbytes
        if held_bytes + buffer_bytes > self._byte_limit:
            raise LimitExceeded(
                f"this attach hands over {buffer_bytes} bytes of device buffers and peer {key}'s "
                f"sessions already hold {held_bytes}: over limits.max_buffer_bytes_per_peer="
                f"{self._byte_limit}; detach sessions it no longer uses, or declare buffers of the "
                "size the pools use",
                "limits.max_buffer_bytes_per_peer",
            )
        held_maps = sum(b.mappings for b in holding)
        if held_maps + buffers.mappings > self._mapping_limit:
            raise LimitExceeded(
                f"this attach maps its device buffers in {buffers.mappings} pieces and peer {key}'s "
                f"sessions already hold {held_maps}: over limits.max_mappings_per_peer="
                f"{self._mapping_limit}; put each pool's buffers next to each other in one memfd "
                "(buffers more than 1 MiB apart are mapped apart), or detach sessions it no longer uses",
                "limits.max_mappings_per_peer",
            )
        self._reserved.setdefault(key, []).append(buffers)

    def settle(self, key: str, session_id: str | None, buffers: Buffers = Buffers()) -> None:
        """The attach reserved with ``buffers`` finished: as ``session_id``, or failed (None)."""
        reserved = self._reserved.get(key, [])
        if buffers in reserved:
            reserved.remove(buffers)
        if not reserved:
            self._reserved.pop(key, None)
        if session_id is not None:
            self._sessions.setdefault(key, {})[session_id] = buffers


class _PeerBytes:
    """Bytes each peer holds of one kind, within ``limit`` per peer; one peer's bytes never
    refuse another's, and a peer holding nothing is always admitted (what one call adds is
    bounded elsewhere)."""

    RETRY_AFTER_MS = 1000  # when a refused client may ask again

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._held: dict[str, int] = {}

    def hold(self, key: str, nbytes: int, what: str) -> None:
        """Count ``nbytes`` for peer ``key``; ResourceExhausted (with a retry hint) when that
        takes it past the limit."""
        held = self._held.get(key, 0)
        if held and held + nbytes > self._limit:
            raise ResourceExhausted(
                self._refusal(key, held, nbytes, what), retry_after_ms=self.RETRY_AFTER_MS
            )
        self._held[key] = held + nbytes

    def release(self, key: str, nbytes: int) -> None:
        """What :meth:`hold` counted for ``key`` is no longer held."""
        left = self._held.get(key, 0) - nbytes
        if left > 0:
            self._held[key] = left
        else:
            self._held.pop(key, None)

    def _refusal(self, key: str, held: int, nbytes: int, what: str) -> str:
        raise NotImplementedError


class HeldRequests(_PeerBytes):
    """Bytes of requests each peer's calls hold, parsed, until the call ends.

    A call keeps its request while it waits for a lane (each lane bounds one session's calls,
    and a peer may attach many sessions), so without a bound a peer's queued calls could
    hold any amount (a PutBytes carries up to ``server.max_message_bytes``). Counted in wire
    bytes (:mod:`hicached.server.held` says which requests count).
    """

    RETRY_AFTER_MS = 100  # held requests go as the calls ahead end

    def _refusal(self, key: str, held: int, nbytes: int, what: str) -> str:
        return (
            f"{what}: peer {key}'s calls in flight hold {held} bytes of requests; {nbytes} more "
            f"exceed limits.max_request_bytes_held_per_peer={self._limit}: wait for calls in "
            "flight to end"
        )


class UnreadAnswers(_PeerBytes):
    """Bytes of large answers each peer's calls hold until the peer has read them.

    gRPC keeps an answer the peer does not read (its flow-control window closed) until the
    peer reads it or the connection is dropped (``server.keepalive_s``); the call's done
    callback runs only then, so bytes held from the answer's reservation to that callback
    bound what a peer that stops reading can make the daemon hold. The answer's own size is
    bounded by ``limits.max_response_bytes``.
    """

    RETRY_AFTER_MS = 1000  # held answers go as the peer's clients read them

    def _refusal(self, key: str, held: int, nbytes: int, what: str) -> str:
        return (
            f"{what}: peer {key} holds {held} bytes of answers it has not read yet; {nbytes} more "
            f"exceed limits.max_unread_answer_bytes_per_peer={self._limit}: read the answers of "
            "calls in flight (or cancel them) first"
        )
