"""A lane's ring gives its memory back when the lane ends, though the client keeps the memfd.

The daemon reads each record out of the ring, as long as its header declares (up to ~1 MiB a
slot); reading pages the client never wrote faults them in, charged to the daemon. Before, the
daemon only unmapped the ring at close: a client that kept its memfd descriptor and opened lane
after lane grew the daemon's memory by ~4 MiB a lane, past `server.fast_lane_max` x 8 MiB, and
under a memory limit got it killed. Now the ring's pages are released when the lane ends: all
of them when the client is gone, the request slots when the daemon ends the lane (the client
may still read its last completion).
"""

from __future__ import annotations

import mmap
import os
import select
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from hicached_client import lane_wire as w
from hicached_client.fastlane import lane_path

from tests.fastlane.conftest import Worker, open_worker
from tests.support.daemon import Daemon

MIB = 1 << 20


class RawLane:
    """A lane negotiated by hand, holding every descriptor the daemon sends (its memfd too)."""

    def __init__(self, daemon: Daemon, session_id: str, secret: str) -> None:
        path = lane_path(daemon.target)
        assert path is not None
        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.conn.settimeout(30)
        self.conn.connect(path)
        self.conn.sendall(f"{w.NEGOTIATE_MAGIC.decode()} {session_id} {secret}\n".encode())
        line, fds, _, _ = socket.recv_fds(self.conn, w.MAX_NEGOTIATE, 4)
        assert line.startswith(b"ok"), line
        self.memfd, self.submit, self.done, layer = fds
        os.close(layer)
        self.ring = mmap.mmap(self.memfd, w.RING_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def declare_and_submit(self, records: int) -> None:
        """``records`` WRITE records whose one transfer declares ~1 MiB of page indices that are
        never written (each is refused); waits for their completions."""
        declared = w.MAX_PAGES - 8
        for seq in range(records):
            offset = w.request_offset(seq)
            w.REQUEST.pack_into(self.ring, offset, w.REQUEST_MAGIC, w.VERSION, w.Opcode.WRITE, 0, 1, seq, b"")
            w.TRANSFER.pack_into(self.ring, offset + w.REQUEST.size, b"kv", declared, 0, 0, 0)
        counters = np.frombuffer(self.ring, dtype=np.int64, count=w.LAYER_SEQ // 8)
        counters[w.SQ_TAIL // 8] = records
        os.eventfd_write(self.submit, 1)
        poller = select.poll()
        poller.register(self.done, select.POLLIN)
        while int(counters[w.CQ_TAIL // 8]) < records:
            assert poller.poll(30_000), "no completion within 30 s"
            os.eventfd_read(self.done)
        del counters

    def completion(self, seq: int) -> w.Completion:
        return w.read_completion(memoryview(self.ring), w.completion_offset(seq))

    def resident(self) -> int:
        """Bytes of the ring's memfd backed by memory."""
        return os.fstat(self.memfd).st_blocks * 512

    def wait_for_daemon_close(self) -> None:
        assert self.conn.recv(1) == b"", "the daemon wrote to a lane it should have closed"

    def close(self) -> None:
        self.ring.close()
        for fd in (self.memfd, self.submit, self.done):
            os.close(fd)
        self.conn.close()


@contextmanager
def raw_lane(daemon: Daemon) -> Iterator[tuple[RawLane, Worker]]:
    with open_worker(daemon, model="m-ring-memory") as worker:
        info = worker.session.info
        lane = RawLane(daemon, info.session_id, info.session_secret)
        try:
            yield lane, worker
        finally:
            lane.close()


def test_a_lane_the_client_closes_gives_back_every_page_of_its_ring(daemon: Daemon) -> None:
    with raw_lane(daemon) as (lane, _):
        lane.declare_and_submit(w.SLOTS)
        assert lane.completion(0).ok is False
        assert lane.resident() >= w.SLOTS * MIB  # the daemon read every declared byte
        lane.conn.shutdown(socket.SHUT_WR)  # EOF: the client is gone, its memfd kept
        lane.wait_for_daemon_close()
        assert lane.resident() == 0


def test_a_lane_its_session_ends_gives_back_its_request_slots_and_keeps_the_completions(
    daemon: Daemon,
) -> None:
    with raw_lane(daemon) as (lane, worker):
        lane.declare_and_submit(w.SLOTS)
        last = lane.completion(w.SLOTS - 1)
        worker.session.detach()
        lane.wait_for_daemon_close()
        assert lane.resident() < MIB  # the header, layer marks and four completions
        assert lane.completion(w.SLOTS - 1) == last  # still readable after the daemon's close
