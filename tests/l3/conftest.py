"""Backend fixtures for the L3 tests.

Extension point: the conformance suite (``test_conformance.py``) runs once per
name in ``BACKEND_FIXTURES``. To add a backend, define a fixture that yields
a fresh, empty, open backend against a real server (and closes it), then
append its name here.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicached.l3 import StorageBackend, create_backend
from hicached.testing.servers import RedisServer, redis_server

from .test_mooncake_fixtures import mooncake_backend, mooncake_srv  # noqa: F401 - fixtures
from .test_s3_fixtures import s3_backend, seaweed_srv  # noqa: F401 - fixtures

BACKEND_FIXTURES = ["file_backend", "redis_backend", "s3_backend", "mooncake_backend"]


@pytest.fixture(params=BACKEND_FIXTURES)
def backend(request: pytest.FixtureRequest) -> StorageBackend:
    result: StorageBackend = request.getfixturevalue(request.param)
    return result


@pytest.fixture
def file_dir(tmp_path: Path) -> Path:
    return tmp_path / f"l3-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def file_backend(file_dir: Path) -> Iterator[StorageBackend]:
    backend = create_backend("file", {"path": str(file_dir), "capacity_bytes": 64 << 20})
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def redis_srv() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


@pytest.fixture
def redis_backend(redis_srv: RedisServer) -> Iterator[StorageBackend]:
    # A fresh key prefix per test keeps tests apart; the database is flushed
    # so whole-database stats start from zero.
    backend = create_backend("redis", {"port": redis_srv.port, "batch_pages": 16})
    backend.clear()
    yield backend
    backend.clear()
    backend.close()
