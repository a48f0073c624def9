"""Fixtures of the ``s3`` backend: one SeaweedFS S3 gateway per session and a
fresh, empty backend per test. Imported by ``conftest.py`` (which lists
``s3_backend`` in ``BACKEND_FIXTURES`` for the conformance suite) so that every
module shares the one server; this module holds no tests.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from hicached.l3 import StorageBackend, create_backend
from hicached.testing.servers import SeaweedFS, seaweedfs

__all__ = ["s3_backend", "s3_options", "seaweed_srv"]


@pytest.fixture(scope="session")
def seaweed_srv() -> Iterator[SeaweedFS]:
    with seaweedfs() as server:
        yield server


def s3_options(srv: SeaweedFS, **extra: object) -> dict[str, object]:
    options: dict[str, object] = {
        "bucket": srv.bucket,
        "endpoint_url": srv.endpoint_url,
        "access_key_id": srv.access_key_id,
        "secret_access_key": srv.secret_access_key,
        "prefix": f"t-{os.getpid()}-{uuid.uuid4().hex[:8]}/",
        "stats_ttl_s": 0,
        "threads": 4,
    }
    options.update(extra)
    return options


@pytest.fixture
def s3_backend(seaweed_srv: SeaweedFS) -> Iterator[StorageBackend]:
    # A fresh object prefix per test: the backend starts empty and clear()
    # touches only this test's objects.
    backend = create_backend("s3", s3_options(seaweed_srv))
    yield backend
    backend.clear()
    backend.close()
