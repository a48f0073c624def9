"""The daemon the integration tests share: :func:`hicached.testing.daemon.launch` with the
suite's defaults (no L3, a small host budget, short leases)."""

from __future__ import annotations

from pathlib import Path

from hicached.testing.daemon import Daemon, launch, wait_serving

__all__ = ["HOST_BUDGET", "LEASE_MS", "MAX_BATCH_PAGES", "ROOT", "Daemon", "start_daemon", "wait_serving"]

ROOT = Path(__file__).resolve().parents[2]
HOST_BUDGET = "256MiB"
LEASE_MS = 1500
MAX_BATCH_PAGES = 512


def start_daemon(*extra: str, timeout_s: float = 60.0) -> Daemon:
    """A serving daemon in a new scratch directory (removed by ``stop``); ``extra`` flags
    come last, so they override the defaults."""
    return launch(
        "--l3", "none",
        "--host-budget", HOST_BUDGET,
        "--lease-ms", str(LEASE_MS),
        "--set", f"server.max_batch_pages={MAX_BATCH_PAGES}",
        *extra,
        timeout_s=timeout_s,
    )  # fmt: skip
