"""Fixtures of the ``mooncake`` backend: one ``mooncake_master`` with a
``mooncake_client`` segment host per session and a fresh, empty backend per
test. Imported by ``conftest.py`` (which lists ``mooncake_backend`` in
``BACKEND_FIXTURES`` for the conformance suite) so that every module shares
the one master; this module holds no tests.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from hicached.l3 import StorageBackend, create_backend
from hicached.testing.servers import MooncakeMaster, mooncake_master

__all__ = ["mc_options", "mooncake_backend", "mooncake_srv"]


@pytest.fixture(scope="session")
def mooncake_srv() -> Iterator[MooncakeMaster]:
    with mooncake_master(segment_bytes=128 << 20) as server:
        yield server


def mc_options(srv: MooncakeMaster, **extra: object) -> dict[str, object]:
    options: dict[str, object] = {
        "master_addr": srv.master_addr,
        "key_prefix": f"t-{os.getpid()}-{uuid.uuid4().hex[:8]}/",
        "staging_bytes": 4 << 20,
        "local_buffer_bytes": 4 << 20,
    }
    options.update(extra)
    return options


@pytest.fixture
def mooncake_backend(mooncake_srv: MooncakeMaster) -> Iterator[StorageBackend]:
    # A fresh key prefix per test: the backend starts empty and clear()
    # touches only this test's pages.
    backend = create_backend("mooncake", mc_options(mooncake_srv))
    yield backend
    backend.clear()
    backend.close()
