"""An error answers the same over the lane and over gRPC: code, message (its wording for an
exhausted daemon, its cut when overlong) and retry hint, from one mapping
(``hicached.server.status.answer_for``).

The errors come from inside the core, where no request can reach them on demand: the daemon's
``HiCacheCore.write`` is patched before it starts to raise the error a marker page asks for.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from hicached_client import HiCacheError, Transfer
from hicached_client import lane_wire as w

from hicached.server.interceptors import MAX_MESSAGE_CHARS
from tests.fastlane.conftest import open_worker
from tests.support.daemon import Daemon
from tests.support.faults import log_lines, serve_patched

# The first device page of a Write picks the error the core raises.
FAULTY_WRITE = """
import errno, os
from hicached import errors
from hicached.core.service import HiCacheCore
_write = HiCacheCore.write
def _faulty(self, session_id, op_id, transfers, **kw):
    page = int(transfers[0].device_indices[0]) if transfers and len(transfers[0].device_indices) else -1
    if page == 901:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
    if page == 902:
        raise errors.InvalidArgument("naïve " * 1000)
    if page == 903:
        raise RuntimeError("a bug " * 600)
    if page == 904:
        raise errors.ResourceExhausted("busy: try again", retry_after_ms=250)
    return _write(self, session_id, op_id, transfers, **kw)
HiCacheCore.write = _faulty
"""


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    d = serve_patched(FAULTY_WRITE)
    try:
        yield d
    finally:
        d.stop()


def _answers(daemon: Daemon, page: int) -> tuple[HiCacheError, HiCacheError]:
    """The error of a Write of ``page``: over the lane, then over gRPC (same session)."""
    with open_worker(daemon, "m-err") as worker:
        with pytest.raises(HiCacheError) as on_lane:
            worker.lane.write([Transfer("kv", [page])], allocate=True)
        with pytest.raises(HiCacheError) as on_grpc:
            worker.session.write([Transfer("kv", [page])], allocate=True)
        return on_lane.value, on_grpc.value


def _same(on_lane: HiCacheError, on_grpc: HiCacheError) -> None:
    assert (on_lane.code, on_lane.message, on_lane.retry_after_ms) == (
        on_grpc.code,
        on_grpc.message,
        on_grpc.retry_after_ms,
    )


def test_an_exhausted_daemon_says_so_alike_on_both(daemon: Daemon) -> None:
    """Fails before: the lane sent the OSError's bare text ('[Errno 24] Too many open files')."""
    on_lane, on_grpc = _answers(daemon, 901)
    assert on_grpc.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert on_grpc.message.startswith("the daemon is out of resources in Write: EMFILE"), on_grpc.message
    _same(on_lane, on_grpc)


def test_an_overlong_message_is_cut_alike_on_both(daemon: Daemon) -> None:
    """Fails before: the lane cut the message at 256 bytes (mid-character), gRPC at
    MAX_MESSAGE_CHARS characters with the length said."""
    on_lane, on_grpc = _answers(daemon, 902)
    assert on_grpc.code is grpc.StatusCode.INVALID_ARGUMENT
    assert len(on_grpc.message.encode()) > w.MESSAGE_BYTES, "longer than the completion's fixed field"
    assert on_grpc.message == ("naïve " * 1000)[:MAX_MESSAGE_CHARS] + "... (6000 chars)"
    _same(on_lane, on_grpc)


def test_a_bug_is_internal_and_named_alike_on_both(daemon: Daemon) -> None:
    """Fails before: the lane's message did not name the RPC ('internal error: ...')."""
    on_lane, on_grpc = _answers(daemon, 903)
    assert on_grpc.code is grpc.StatusCode.INTERNAL
    assert on_grpc.message.startswith("internal error in Write: RuntimeError: a bug"), on_grpc.message
    _same(on_lane, on_grpc)
    assert len(log_lines(daemon, "internal error in Write")) >= 2, "logged on both paths"


def test_a_retry_hint_reaches_both(daemon: Daemon) -> None:
    on_lane, on_grpc = _answers(daemon, 904)
    assert (on_grpc.code, on_grpc.retry_after_ms) == (grpc.StatusCode.RESOURCE_EXHAUSTED, 250)
    _same(on_lane, on_grpc)
