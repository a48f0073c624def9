"""Fixtures most test modules share: one real daemon per module, with the suite's defaults
(:func:`tests.support.daemon.start_daemon`; a module that needs other flags defines its own
``daemon``, which takes precedence), shared-memory worker pools, and a warm-restart prefix."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.daemon import Daemon, start_daemon
from tests.support.kv import WorkerPools
from tests.support.warm import Warm


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    d = start_daemon()
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def worker_pools() -> Iterator[list[WorkerPools]]:
    """Shared-memory "device" pools a test makes (it appends them); every segment is
    unlinked at the end."""
    made: list[WorkerPools] = []
    yield made
    for pools in made:
        pools.close()


@pytest.fixture
def warm(tmp_path: Path) -> Iterator[Warm]:
    w = Warm(prefix=f"hcwr{uuid.uuid4().hex[:10]}", journal_dir=tmp_path / "journal")
    try:
        yield w
    finally:
        # Warm-restart segments outlive their daemon by design; these are test-only.
        for seg in Path("/dev/shm").glob(f"{w.prefix}*"):
            with contextlib.suppress(FileNotFoundError):
                seg.unlink()
