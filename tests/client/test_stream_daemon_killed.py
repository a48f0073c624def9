"""A Load or RetractRestore under way when the daemon dies ends by its deadline, in both clients.

Found by a review that killed daemons under working clients: with the channel retrying the
streams, grpcio's blocking client waited forever for a stream whose connection died after its
request was sent (30 s and more with ``timeout_s=5``, the daemon restarted or not; the
worker's thread stuck in ``LoadStream.__next__``). The client now retries the streams itself
(same op_id, before the first message, within the deadline), and the call fails UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable

import grpc
import pytest
from hicached_client import AsyncHiCacheClient, HiCacheClient, HiCacheError, Session, Transfer, WorkerIdentity

from tests.support.faults import log_lines, serve_patched
from tests.support.kv import WorkerPools, unique_tag
from tests.support.state import poll

# The daemon's first Load or RetractRestore says "HELD", then waits for a line on stdin.
HELD_STREAM = """
import sys
import hicached.core.service as service
def held(name):
    real = getattr(service.HiCacheCore, name)
    def call(self, *args, **kwargs):
        print("HELD", name, flush=True)
        sys.stdin.readline()
        return real(self, *args, **kwargs)
    setattr(service.HiCacheCore, name, call)
held("load")
held("retract_restore")
"""
TIMEOUT_S = 5.0
Call = Callable[[Session, list[int], str], object]  # (session, its host pages, a backup id)


def load(session: Session, host: list[int], backup: str) -> object:
    return session.load_wait([Transfer("kv", [5, 6], host)])


def restore(session: Session, host: list[int], backup: str) -> object:
    return session.retract_restore_wait(backup, [Transfer("kv", [7, 8])])


def load_async(session: Session, host: list[int], backup: str) -> object:
    async def run() -> object:
        async with AsyncHiCacheClient(session.client.config.target, timeout_s=TIMEOUT_S) as client:
            same = client.session(session.info.session_id, session_secret=session.info.session_secret)
            return await same.load_wait([Transfer("kv", [5, 6], host)])

    return asyncio.run(run())


@pytest.mark.parametrize("call", [load, restore, load_async], ids=["load", "retract_restore", "async_load"])
def test_a_stream_under_way_when_the_daemon_dies_fails_by_its_deadline(call: Call) -> None:
    read, release = os.pipe()
    d = serve_patched(HELD_STREAM, stdin=read)
    os.close(read)
    pools = WorkerPools.create(unique_tag("killed"))
    outcome: list[tuple[object, float]] = []
    try:
        with HiCacheClient(d.target, timeout_s=TIMEOUT_S) as client:
            worker = WorkerIdentity(unique_tag("w"), 1, "m-killed")
            session = client.attach(worker, pools.specs(), heartbeat=False)
            host = list(session.write([Transfer("kv", [0, 1])], allocate=True).transfers[0].host_pages)
            backup = session.retract_backup("req", [Transfer("kv", [0, 1])], 8).backup_id

            def run() -> None:
                began = time.monotonic()
                try:
                    call(session, host, backup)
                    outcome.append(("returned", time.monotonic() - began))
                except HiCacheError as exc:
                    outcome.append((exc.code, time.monotonic() - began))

            caller = threading.Thread(target=run, daemon=True)  # a hung call must not hang the suite
            caller.start()
            poll(lambda: log_lines(d, "HELD"), bool, 30.0, "the daemon holding the stream")
            os.kill(d.process.pid, signal.SIGKILL)
            caller.join(TIMEOUT_S + 20)
            assert not caller.is_alive(), f"the call was still blocked {TIMEOUT_S + 20} s after the kill"
    finally:
        os.close(release)
        pools.close()
        d.stop()
    code, took = outcome[0]
    assert code == grpc.StatusCode.UNAVAILABLE, outcome
    assert took < TIMEOUT_S + 5, outcome
