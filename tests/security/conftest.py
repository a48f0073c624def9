"""Fixtures shared by the security tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.daemon import Daemon, start_daemon
from tests.support.faults import metrics_port


@pytest.fixture(scope="module")
def metrics_served() -> Iterator[tuple[Daemon, int]]:
    """A daemon of the module serving /metrics on a free port, and that port."""
    daemon = start_daemon("--metrics-port", "0")
    try:
        yield daemon, metrics_port(daemon)
    finally:
        daemon.stop()
