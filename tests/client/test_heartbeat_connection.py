"""Heartbeats take a connection of their own, one per process (so data calls filling a
connection cannot hold them back: tests/robustness/test_loop_stalls.py), and a daemon refusing
that connection does not end a session whose data calls still get through. Real daemons."""

from __future__ import annotations

import logging
import uuid

import pytest
from hicached_client import HiCacheClient, Session, WorkerIdentity

from tests.robustness.loop_support import byte_spec
from tests.support.daemon import start_daemon
from tests.support.state import poll

LEASE_MS = 1500
FALLBACK = "beating on the data connection"


def _beating(client: HiCacheClient) -> Session:
    # Connected first: at server.max_connections=1, a connection made while the launcher's
    # readiness probe was still counted was refused, and the attach with it (once in CI).
    client.wait_ready(10.0)
    identity = WorkerIdentity(f"hb-{uuid.uuid4().hex[:8]}", 1, "m-hb")
    return client.attach(identity, [byte_spec()], lease_ms=LEASE_MS)  # heartbeats on


def _three_beats_each(sessions: list[Session]) -> None:
    start = [s.heartbeats for s in sessions]
    poll(
        lambda: [s.heartbeats - n for s, n in zip(sessions, start, strict=True)],
        lambda beats: min(beats) >= 3,
        20.0,
        "three more heartbeats of every session",
    )
    assert [s.lease_lost for s in sessions] == [None] * len(sessions)


def test_the_clients_of_a_process_share_one_heartbeat_connection(caplog: pytest.LogCaptureFixture) -> None:
    """Fails on the first cut (a heartbeat connection per client): six clients of one process
    opened seven connections, and past server.max_connections their sessions expired. Now
    they take two, and no heartbeat needs the data connection."""
    caplog.set_level(logging.WARNING, logger="hicached_client")
    d = start_daemon("--set", "server.max_connections=2")
    clients = [HiCacheClient(d.target, timeout_s=10.0) for _ in range(6)]
    try:
        sessions = [_beating(client) for client in clients]
        _three_beats_each(sessions)
        assert not [r for r in caplog.records if FALLBACK in r.getMessage()], caplog.text
        for session in sessions:
            session.detach()
    finally:
        for client in clients:
            client.close()
        d.stop()


def test_a_refused_heartbeat_connection_beats_on_the_data_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Fails before the fallback: a daemon at server.max_connections refused the heartbeats'
    connection while the data calls' one worked, and the session expired (Detach: NOT_FOUND)."""
    caplog.set_level(logging.WARNING, logger="hicached_client")
    d = start_daemon("--set", "server.max_connections=1")
    try:
        with HiCacheClient(d.target, timeout_s=10.0) as client:
            session = _beating(client)
            _three_beats_each([session])
            assert [r for r in caplog.records if FALLBACK in r.getMessage()]
            session.detach()
    finally:
        d.stop()


def test_a_daemon_that_is_down_costs_one_warning_a_beat(caplog: pytest.LogCaptureFixture) -> None:
    """Fails before (found at stop 47): each failed beat logged twice, the fallback to the
    data connection ("beating on the data connection") and the session's "heartbeat failed
    (will retry)", though the beat got through on neither."""
    caplog.set_level(logging.WARNING, logger="hicached_client")
    d = start_daemon()
    try:
        with HiCacheClient(d.target, timeout_s=10.0) as client:
            session = _beating(client)
            _three_beats_each([session])
            d.stop()
            poll(
                lambda: [r for r in caplog.records if "heartbeat failed (will retry)" in r.getMessage()],
                lambda failed: len(failed) >= 2,
                20.0,
                "two failed heartbeats",
            )
            assert not [r for r in caplog.records if FALLBACK in r.getMessage()], caplog.text
    finally:
        d.stop()
