"""A session whose operation outlives the shutdown's grace period (review 28, finding 6).

Its teardown is deferred to the end of that operation, which now comes after the daemon
closed the pool groups: it must end the session quietly (the groups' close freed its pages;
its mappings are closed), not fail with NotFound and leave them mapped.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any

import numpy as np
from hicached_client import HiCacheClient, HiCacheError, PageBytes

from tests.robustness.loop_support import PAGE_BYTES, attach_bytes
from tests.support.faults import log_lines, serve_patched
from tests.support.state import poll

# A PutBytes holds its session in flight after its work is done, until stdin has a line;
# the groups' close says when it is over.
HELD_PUT = """
import hicached.core.sessions as sessions
import hicached.core.groups as groups
_run = sessions.Session.run
def run(self, rpc, op_id, body, fn, *, in_flight=True):
    def held():
        out = fn()
        if rpc == "PutBytes":
            print("PUT HELD", flush=True)
            sys.stdin.readline()
        return out
    return _run(self, rpc, op_id, body, held, in_flight=in_flight)
sessions.Session.run = run
_close = groups.GroupRegistry.close
def close(self):
    _close(self)
    print("GROUPS CLOSED", flush=True)
groups.GroupRegistry.close = close
"""


def test_a_teardown_deferred_past_the_groups_close_ends_the_session_quietly() -> None:
    """Fails before the fix: "deferred teardown of session ... failed" with NotFound (unknown
    pool group) at ERROR, and the session's mappings were never closed."""
    read, write = os.pipe()
    d = serve_patched(HELD_PUT, "--set", "server.grace_s=0", stdin=read)
    os.close(read)
    errors: list[BaseException] = []
    try:
        with HiCacheClient(d.target, timeout_s=30.0) as client:
            session = attach_bytes(client, "m-held")
            data = np.random.default_rng(6).integers(0, 256, PAGE_BYTES, dtype=np.uint8).tobytes()

            def put() -> None:
                try:
                    session.put_bytes([PageBytes("k-held", "kv", data)])
                except HiCacheError as exc:  # the shutdown cancels the call
                    errors.append(exc)

            putter = threading.Thread(target=put)
            putter.start()
            poll(lambda: log_lines(d, "PUT HELD"), bool, 30.0, "the put held in flight")
            d.process.terminate()
            poll(lambda: log_lines(d, "GROUPS CLOSED"), bool, 30.0, "the groups closed")
            os.write(write, b"go\n")  # the operation ends: its deferred teardown runs now
            assert d.process.wait(timeout=60) == 0, d.log[-3000:]
            putter.join(timeout=30)
        assert not log_lines(d, "deferred teardown"), d.log[-3000:]
        assert not log_lines(d, "NotFound"), d.log[-3000:]
        assert log_lines(d, "session ended after its pool group closed")
        # Closing with a zero grace period left the acceptor polling a closed stop pipe and
        # listener: it spun on EBADF, one warning per accept.
        assert not log_lines(d, "fast lane accept failed"), d.log[-3000:]
    finally:
        os.close(write)
        d.stop()


def test_sessions_busy_at_shutdown_share_one_grace_period() -> None:
    """Fails before the fix: the sessions were ended one after another, each waited up to
    ``server.grace_s`` for its call, so five stuck calls held the groups' close (the warm
    journals) back 1 + 5 x 1 s, past a pod's grace period at the shipped values (review)."""
    read, write = os.pipe()
    d = serve_patched(HELD_PUT, "--set", "server.grace_s=1", stdin=read)
    os.close(read)
    sessions = 5
    try:
        with HiCacheClient(d.target, timeout_s=30.0) as client:
            data = bytes(PAGE_BYTES)
            putters = []
            for i in range(sessions):
                session = attach_bytes(client, "m-busy")

                def put(s: Any = session, key: str = f"k-busy-{i}") -> None:
                    with contextlib.suppress(HiCacheError):  # the shutdown cancels the call
                        s.put_bytes([PageBytes(key, "kv", data)])

                putters.append(threading.Thread(target=put))
                putters[-1].start()
            poll(lambda: len(log_lines(d, "PUT HELD")), lambda n: n == sessions, 30.0, "every put held")
            start = time.monotonic()
            d.process.terminate()
            poll(lambda: log_lines(d, "GROUPS CLOSED"), bool, 60.0, "the groups closed")
            took = time.monotonic() - start
            # EOF ends every held readline at once (lines may be read ahead by one of them).
            os.close(write)
            write = -1
            assert d.process.wait(timeout=60) == 0, d.log[-3000:]
            for t in putters:
                t.join(timeout=30)
        assert len(log_lines(d, "session ended with operations in flight")) == sessions
        # One grace period in all (~1 s), not one each (~5.5 s); the rest is room for a slow machine.
        assert took < 3.5, f"the groups closed {took:.1f} s after SIGTERM"
    finally:
        if write >= 0:
            os.close(write)
        d.stop()
