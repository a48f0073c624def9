"""Fixtures of the issue-3 acceptance tests: one real daemon per module, a client."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hicached_client import HiCacheClient

from tests.support.daemon import Daemon


@pytest.fixture
def client(daemon: Daemon) -> Iterator[HiCacheClient]:
    with HiCacheClient(daemon.target, timeout_s=30.0) as c:
        yield c


@pytest.fixture
def admin(daemon: Daemon) -> Iterator[HiCacheClient]:
    """A client on the admin socket: GetStats lists every session and backup there."""
    with HiCacheClient(daemon.admin_target, timeout_s=30.0) as c:
        yield c
