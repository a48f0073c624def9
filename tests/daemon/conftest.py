"""Fixtures of the issue-5 operating tests: real daemons (``python -m hicached serve``) with the
file L3 backend in a temp dir, shared-memory worker pools, and the daemon's own HTTP /metrics."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hicached.testing.procs import free_ports
from tests.support.daemon import Daemon, start_daemon
from tests.support.kv import WorkerPools, unique_tag


def free_port() -> int:
    """A TCP port nobody listens on now (the daemon cannot report the port it picked for 0)."""
    return free_ports(1)[0]


def start_file_daemon(l3: Path, *extra: str) -> Daemon:
    """A daemon whose L3 is the file backend in ``l3`` (the directory survives the daemon)."""
    return start_daemon("--l3", "file", "--l3-path", str(l3), *extra)


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of ``http://127.0.0.1:port/metrics`` by (name, labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)


@pytest.fixture
def l3_dir(tmp_path: Path) -> Path:
    return tmp_path / "l3"


@pytest.fixture
def worker_pools() -> Iterator[list[WorkerPools]]:
    """Shared-memory "device" pools made by a test; every segment is unlinked at the end."""
    made: list[WorkerPools] = []
    yield made
    for pools in made:
        pools.close()


def new_pools(made: list[WorkerPools], seed: int | None) -> tuple[str, WorkerPools]:
    tag = unique_tag("dw")
    pools = WorkerPools.create(tag)
    made.append(pools)
    if seed is None:
        pools.clobber()
    else:
        pools.fill_random(seed)
    return tag, pools
