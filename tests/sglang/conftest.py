"""Fixtures: one live hicached daemon for the module, SGLang storages made through its factory."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import tests.sglang.env  # noqa: F401  (before any SGLang import)
from tests.sglang.pools import StorageFactory
from tests.support.daemon import Daemon, start_daemon

SHM_DIR = Path("/dev/shm")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    l3_dir = tmp_path_factory.mktemp("l3")
    d = start_daemon("--l3", "file", "--l3-path", str(l3_dir))
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def storages(daemon: Daemon) -> Iterator[StorageFactory]:
    factory = StorageFactory(daemon.target)
    try:
        yield factory
    finally:
        factory.close_all()


@pytest.fixture(autouse=True)
def no_leaked_staging() -> Iterator[None]:
    """Every staging segment's name is gone once its pool is attached (or failed to)."""
    pattern = f"hicached-sgl-{os.getpid()}-*"
    before = {p.name for p in SHM_DIR.glob(pattern)}
    yield
    leaked = {p.name for p in SHM_DIR.glob(pattern)} - before
    assert not leaked, f"staging segments left in /dev/shm: {sorted(leaked)}"
