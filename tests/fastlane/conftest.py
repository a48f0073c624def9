"""Fixtures of the fast-lane tests: one real daemon (socket mode 0666 so a second uid can
reach it), an admin client for GetStats, and a worker with real pools, a session and a lane."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from hicached_client import HiCacheClient, Session, WorkerIdentity
from hicached_client.fastlane import FastLane

from tests.support.daemon import Daemon, start_daemon
from tests.support.kv import WorkerPools, unique_tag


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    d = start_daemon(
        "--set", "server.socket_mode=0o666", "--set", "server.fast_lane_max_per_session=3",
        "--set", "server.fast_lane_max_per_uid=5",
    )  # fmt: skip
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def admin(daemon: Daemon) -> Iterator[HiCacheClient]:
    with HiCacheClient(daemon.admin_target, timeout_s=30.0) as c:
        yield c


@dataclass
class Worker:
    pools: WorkerPools
    client: HiCacheClient
    session: Session
    lane: FastLane


@contextlib.contextmanager
def open_worker(daemon: Daemon, model: str = "m-fastlane") -> Iterator[Worker]:
    """Real pools, a client, an attached session of ``model`` and its lane; all closed after."""
    pools = WorkerPools.create(unique_tag("fl"))
    try:
        with HiCacheClient(daemon.target, timeout_s=30.0) as client:
            session = client.attach(WorkerIdentity(f"w-{uuid.uuid4().hex[:8]}", 1, model), pools.specs())
            lane = FastLane.open(session)
            try:
                yield Worker(pools, client, session, lane)
            finally:
                lane.close()
                session.close()
    finally:
        for p in (pools.kv, pools.draft):
            p.close()
            p.unlink()


@pytest.fixture
def worker(daemon: Daemon) -> Iterator[Worker]:
    with open_worker(daemon) as w:
        yield w


@pytest.fixture
def pools() -> Iterator[WorkerPools]:
    """Real pools for a test that attaches its own sessions (through other clients)."""
    made = WorkerPools.create(unique_tag("flp"))
    try:
        yield made
    finally:
        made.close()


def free_pages(session: Session) -> dict[str, int]:
    """Free host pages of the session's group, by pool name."""
    return {key.rsplit("/", 1)[1]: n for key, n in session.stats().free_pages().items()}
