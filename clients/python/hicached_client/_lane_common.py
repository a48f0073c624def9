"""What the blocking fast lane (``fastlane.py``) and its asyncio face (``fastlane_aio.py``)
share: the descriptors a lane is made of, the request record of an op, the doorbell, the
errors and the results of completions.

Both lanes call these functions instead of each other's private methods: the asyncio lane
waits on the event loop where the blocking one sleeps in ``poll``, and the rest is here once.
Pure functions over their arguments (no state of their own): thread-safe; the fds passed in
stay owned by the caller.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time
from collections.abc import Callable, Sequence

import grpc
import numpy as np

from hicached_client import lane_wire as w
from hicached_client._convert import check_hit_run, indices
from hicached_client.errors import HiCacheError
from hicached_client.types import (
    GetPagesResult,
    LoadResult,
    LookupResult,
    PageIndices,
    PoolAck,
    PutPagesResult,
    ResolveResult,
    Transfer,
    WriteResult,
)

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_EVENTFD = "anon_inode:[eventfd]"
# A memfd's /proc link: "/memfd:<name> (deleted)".
_MEMFD = "/memfd:"

# An op with less than this of its timeout left once it holds the lane is not sent: it could
# only time out, and a timeout closes the lane (see FastLane.abandon).
MIN_SEND_S = 0.001

# A request record's writer, as FastLane.submit_raw takes it: fill(view, offset, seq).
Fill = Callable[[memoryview, int, int], None]


def unavailable(message: str) -> HiCacheError:
    """The lane is gone or is no lane: the session's op goes over gRPC."""
    return HiCacheError(grpc.StatusCode.UNAVAILABLE, message, method="FastLane")


def closed_by_daemon() -> HiCacheError:
    return unavailable("the daemon closed the fast lane (session ended or daemon stopped)")


def timed_out() -> HiCacheError:
    return HiCacheError(grpc.StatusCode.DEADLINE_EXCEEDED, "fast lane op timed out", method="FastLane")


class Budget:
    """One op's timeout as a deadline, shared by its tries: the lane's, then gRPC's when the
    lane is lost or refuses it (a re-send gets what is left, not a fresh timeout). None: no
    deadline. Not thread-safe (one op's)."""

    def __init__(self, timeout_s: float | None, rpc: str) -> None:
        self._end = None if timeout_s is None else time.monotonic() + timeout_s
        self._rpc = rpc

    def left(self) -> float | None:
        """The time left for the next try; DEADLINE_EXCEEDED, nothing sent, under
        :data:`MIN_SEND_S` (a lane or gRPC call sent then could only time out, or run after
        its caller was told it failed)."""
        if self._end is None:
            return None
        left = self._end - time.monotonic()
        if left < MIN_SEND_S:
            raise HiCacheError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "the op's timeout ran out before it was sent (nothing was sent)",
                method=self._rpc,
            )
        return left


# ------------------------------------------------------------ what a lane is made of


def _link(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


def check_received(memfd: int, doorbells: Sequence[int]) -> None:
    """UNAVAILABLE unless ``memfd`` is a sealed memfd of :data:`lane_wire.RING_BYTES` and every
    doorbell an eventfd. What the other side sent at negotiation is used as such: the client
    writes, polls and reads the doorbells and maps the ring, so a pipe, a socket or a file in
    their place (a broken or hostile daemon's, or an impostor's) is no lane. Each doorbell is
    then made non-blocking (:func:`drain` reads it on an event loop too: a blocking one with
    nothing to read would hold the loop). Closes nothing: the caller closes every received fd
    on failure."""
    st = os.fstat(memfd)
    link = _link(memfd)
    if not stat.S_ISREG(st.st_mode) or not link.startswith(_MEMFD):
        raise unavailable(f"the daemon's lane ring is not a memfd ({link[:40]!r})")
    seals = fcntl.fcntl(memfd, fcntl.F_GET_SEALS)
    if seals & _SEALS != _SEALS or st.st_size != w.RING_BYTES:
        raise unavailable(f"the daemon's lane ring is not sealed or has size {st.st_size}")
    for fd in doorbells:
        if (link := _link(fd)) != _EVENTFD:
            raise unavailable(f"a doorbell the daemon sent is not an eventfd ({link[:40]!r})")
        os.set_blocking(fd, False)


def drain(doorbell: int) -> None:
    """Reset a doorbell that rang (an eventfd in non-blocking mode: nothing to read is fine)."""
    with contextlib.suppress(BlockingIOError):
        os.eventfd_read(doorbell)


# ------------------------------------------------------------ requests


def new_op_id() -> str:
    return os.urandom(16).hex()


def lane_carries(op_id: str) -> bool:
    """Whether a lane record carries ``op_id`` (at most 32 printable ASCII characters): an op
    with any other id goes over gRPC, which takes any within ``limits.max_identity_bytes``."""
    return len(op_id) <= 32 and op_id.isascii() and w.PRINTABLE_OP_ID.fullmatch(op_id.encode()) is not None


def _wire(transfers: Sequence[Transfer]) -> tuple[w.WireTransfer, ...]:
    if isinstance(transfers, Transfer):
        raise TypeError("transfers must be a sequence of Transfer, got a single Transfer")
    return tuple(
        w.WireTransfer(
            t.pool,
            wire_indices(t.device_pages, f"device_pages of pool {t.pool!r}"),
            None if t.host_pages is None else wire_indices(t.host_pages, f"host_pages of pool {t.pool!r}"),
            t.host_allocated,
        )
        for t in transfers
    )


def wire_indices(values: PageIndices, what: str) -> np.ndarray:
    """``values`` as a record's int64 page indices, refused where gRPC's conversion refuses them:
    a float or bool is a TypeError, an integer past int64 a ValueError (a cast would copy other
    pages than the caller named, or wrap to a negative index). An integer array (numpy, or a
    CPU tensor) is taken as it is, without a copy; a list is checked element by element."""
    array = _integer_array(values, what)
    if array is None:
        listed = values if type(values) is list else indices(values, what)  # refuses a str...
        kinds = set(map(type, listed))
        if kinds - _INT and any(k is bool or k is np.bool_ or not hasattr(k, "__index__") for k in kinds):
            names = sorted(k.__name__ for k in kinds)
            raise TypeError(f"{what} must be integers, got {', '.join(names)} values")
        try:
            array = np.asarray(listed, dtype=np.int64)
        except OverflowError:
            raise ValueError(f"{what}: a page index is past the largest ({_INT64_MAX})") from None
    if array.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got an array with ndim={array.ndim}")
    if array.dtype.kind == "u" and array.size and int(array.max()) > _INT64_MAX:
        raise ValueError(f"{what}: {int(array.max())} is past the largest page index ({_INT64_MAX})")
    return array.astype(np.int64, copy=False)


def _integer_array(values: PageIndices, what: str) -> np.ndarray | None:
    """``values`` as an integer numpy array when it is an array of integers (no copy); an array
    of floats or bools is a TypeError; None for anything else (a list: checked element-wise)."""
    if not hasattr(values, "__array__") or isinstance(values, (list, tuple)):
        return None
    try:
        array = np.asarray(values)
    except (TypeError, RuntimeError):  # e.g. a CUDA tensor: element by element, as gRPC does
        return None
    if array.dtype.kind in "iu":
        return array
    if array.dtype.kind in "bfc":
        raise TypeError(f"{what} must be integers, got an array of {array.dtype}")
    return None  # an object array: element by element


_INT64_MAX = int(np.iinfo(np.int64).max)
_INT = {int}


def request(
    opcode: w.Opcode, flags: int, transfers: Sequence[Transfer], op_id: str | None, keys: Sequence[str] = ()
) -> Fill:
    """The writer of one op's request record (a fresh op id when ``op_id`` is None)."""
    op, wire, given = op_id or new_op_id(), _wire(transfers), tuple(keys)

    def fill(view: memoryview, offset: int, seq: int) -> None:
        w.encode_request(view, offset, w.Request(opcode, flags, seq, op, wire, given))

    return fill


# ------------------------------------------------------------ results


def transfers_of(ts: tuple[w.WireTransfer, ...]) -> tuple[Transfer, ...]:
    return tuple(
        Transfer(
            t.pool,
            tuple(int(x) for x in (t.device if t.device is not None else ())),
            tuple(int(x) for x in (t.host if t.host is not None else ())),
            t.host_allocated,
        )
        for t in ts
    )


def acks(c: w.Completion) -> tuple[PoolAck, ...]:
    return tuple(PoolAck(a.pool, a.pages, a.tokens, a.bytes) for a in c.acks)


def write_result(c: w.Completion) -> WriteResult:
    return WriteResult(ok=c.ok, transfers=transfers_of(c.transfers), acks=acks(c))


def load_result(c: w.Completion) -> LoadResult:
    return LoadResult(layers=c.layers, acks=acks(c))


def resolve_result(c: w.Completion) -> ResolveResult:
    return ResolveResult(ok=c.ok, transfers=transfers_of(c.transfers))


def get_pages_result(c: w.Completion) -> GetPagesResult:
    return GetPagesResult(hit_pages=c.value, acks=acks(c))


def lookup_result(c: w.Completion, keys: Sequence[str]) -> LookupResult:
    l2, total = w.lookup_counts(c.value)
    check_hit_run("Lookup", max(l2, total), len(keys))
    return LookupResult(keys=tuple(keys), l2_hit_pages=l2, total_hit_pages=total)


def put_pages_result(c: w.Completion, nkeys: int) -> PutPagesResult:
    # The core counts every key it did not store as existing when ok, none when refused.
    existing = nkeys - c.value if c.ok else 0
    return PutPagesResult(
        ok=c.ok, stored_pages=c.value, existing_pages=existing, acks=acks(c), reason=c.message
    )
