"""A call whose client stopped waiting (its deadline passed) still runs on its lane's thread
until the work ends, so it still counts against the lane's limits: a client cannot take every
thread by giving up on its calls. Real daemon, a hung RESP server as its L3."""

from __future__ import annotations

import contextlib
import os
import threading
import uuid

import grpc
import pytest
from hicached_client import GroupInfo, HiCacheClient, HiCacheError, PageBytes, Session

from tests.robustness.loop_support import PAGE_BYTES, FakeRedis, attach_bytes
from tests.support.daemon import start_daemon
from tests.support.faults import log_lines, serve_patched
from tests.support.state import poll


def test_calls_given_up_by_their_client_keep_their_place_until_their_work_ends() -> None:
    """Before: a cancelled call gave its place back at once while its thread still waited on
    L3, so a session with a 0.3 s deadline per call held every L3 thread and queued without
    bound, and another session's L3 call never got a thread."""
    fake = FakeRedis()
    d = start_daemon(
        *fake.daemon_args(),
        "--set", "server.l3_threads=3",
        "--set", "limits.max_l3_calls_per_session=2",
        "--set", "limits.max_l3_calls_queued=1",
    )  # fmt: skip
    reader: threading.Thread | None = None
    try:
        with HiCacheClient(d.target, timeout_s=10.0) as client:
            hog, bystander = attach_bytes(client, "m-cancel"), attach_bytes(client, "m-cancel")
            fake.hang()
            for _ in range(2):  # the client gives up; the daemon's threads still wait on L3
                with pytest.raises(HiCacheError) as err:
                    hog.get_bytes([uuid.uuid4().hex], include_l3=True, timeout_s=0.3)
                assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            fake.wait_unanswered(2, timeout_s=30)
            for _ in range(4):
                with pytest.raises(HiCacheError) as err:
                    hog.get_bytes([uuid.uuid4().hex], include_l3=True, timeout_s=1.0)
                assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
                assert "limits.max_l3_calls_per_session=2" in err.value.message

            def read(session: Session) -> None:
                with contextlib.suppress(HiCacheError):  # fails once the fake closes
                    session.get_bytes([uuid.uuid4().hex], include_l3=True, timeout_s=30.0)

            reader = threading.Thread(target=read, args=(bystander,), daemon=True)
            reader.start()
            fake.wait_unanswered(3, timeout_s=30)  # the other session reached L3 on the third thread
    finally:
        fake.close()
        if reader is not None:
            reader.join(timeout=30)
        d.stop()


# The daemon's first read of a host page for GetBytes waits for a line on stdin ("READING").
HELD_READ = """
import sys
import hicached.l2.host_pool as hp
_get = hp.HostKVPool.get_page_flat
_held = []
def get_page_flat(self, *args, **kwargs):
    if not _held:
        _held.append(True)
        print("READING", flush=True)
        sys.stdin.readline()
    return _get(self, *args, **kwargs)
hp.HostKVPool.get_page_flat = get_page_flat
"""


def test_a_getbytes_under_way_keeps_its_group_in_use_after_its_session_ends() -> None:
    """Fails before (a review of stop 47): GetBytes reads the host pools without counting as
    an operation in flight, so a session that detached under it left its group idle (no
    session, no hold): another attach could retire the group and close its pools under the
    read. Now the read counts, as every other call that touches pages does."""
    read, release = os.pipe()
    d = serve_patched(HELD_READ, stdin=read)
    os.close(read)
    reader: threading.Thread | None = None
    try:
        with (
            HiCacheClient(d.target, timeout_s=30.0) as client,
            HiCacheClient(d.admin_target, timeout_s=30.0) as admin,
        ):
            session = attach_bytes(client, "m-read")
            key = uuid.uuid4().hex
            assert session.put_bytes([PageBytes(key, "kv", b"\x07" * PAGE_BYTES)]).stored_pages == 1
            got: list[object] = []
            reader = threading.Thread(target=lambda: got.append(session.get_bytes([key])))
            reader.start()
            poll(lambda: log_lines(d, "READING"), bool, 30.0, "the GetBytes reading a page")
            detacher = threading.Thread(target=session.detach)  # it waits for the read now
            detacher.start()

            def group_of_model() -> GroupInfo:
                (group,) = [g for g in admin.get_stats().groups if g.model_name == "m-read"]
                return group

            ended = poll(group_of_model, lambda g: g.sessions == 0, 30.0, "the session ended")
            assert ended.holds == 1, ended  # before: 0, the group idle under the read
            os.write(release, b"go\n")
            reader.join(timeout=30)
            detacher.join(timeout=30)
            assert got and [p.data for p in got[0].pages] == [b"\x07" * PAGE_BYTES]  # type: ignore[attr-defined]
            assert (group_of_model().sessions, group_of_model().holds) == (0, 0)
    finally:
        os.close(release)
        if reader is not None:
            reader.join(timeout=30)
        d.stop()
