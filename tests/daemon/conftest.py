"""Fixtures of the issue-5 operating tests: real daemons (``python -m hicached serve``) with the
file L3 backend in a temp dir, shared-memory worker pools, the daemon's own HTTP /metrics, and
the warm-restart prefix and journal directory successive daemons share."""

from __future__ import annotations

import signal
import urllib.request
from pathlib import Path

import pytest
from hicached_client import HiCacheClient
from prometheus_client.parser import text_string_to_metric_families

from hicached.testing.procs import free_ports
from tests.support.daemon import Daemon, start_daemon
from tests.support.kv import WorkerPools, unique_tag
from tests.support.state import poll


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


def fresh_scrape(port: int, client: HiCacheClient) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """A scrape rendered after this call began. /metrics serves one render for up to a second
    (hicached/metrics_http.py): ping, then scrape until a render counts more pings than the
    one before the ping did (renders only move forward; nothing else in these tests pings)."""
    pings = "hicached_rpcs_total"
    seen = total(scrape(port), pings, method="Ping")
    client.ping(b"fresh scrape")
    return poll(
        lambda: scrape(port), lambda s: total(s, pings, method="Ping") > seen, 10.0, "a render after a ping"
    )


def total(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)


@pytest.fixture
def l3_dir(tmp_path: Path) -> Path:
    return tmp_path / "l3"


def new_pools(made: list[WorkerPools], seed: int | None) -> tuple[str, WorkerPools]:
    tag = unique_tag("dw")
    pools = WorkerPools.create(tag)
    made.append(pools)
    if seed is None:
        pools.clobber()
    else:
        pools.fill_random(seed)
    return tag, pools


def stop_with(daemon: Daemon, sig: signal.Signals, timeout_s: float = 30.0) -> int:
    daemon.process.send_signal(sig)
    code = daemon.process.wait(timeout=timeout_s)
    daemon.stop()  # the process is gone: removes its workdir only (our prefix is not its own)
    return code
