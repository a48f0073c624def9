"""A call whose client stopped waiting (its deadline passed) still runs on its lane's thread
until the work ends, so it still counts against the lane's limits: a client cannot take every
thread by giving up on its calls. Real daemon, a hung RESP server as its L3."""

from __future__ import annotations

import contextlib
import threading
import uuid

import grpc
import pytest
from hicached_client import HiCacheClient, HiCacheError, Session

from tests.robustness.loop_support import FakeRedis, attach_bytes
from tests.support.daemon import start_daemon


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
