"""Observable daemon state for "nothing changed" checks, and deadline-bounded polling."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from hicached_client import HiCacheClient, Stats

T = TypeVar("T")


def snapshot(stats: Stats) -> dict[str, Any]:
    """Everything a failed call must leave unchanged (lease expiries excluded: heartbeats move them)."""
    return {
        "sessions": sorted((s.session_id, s.group, s.owned_pages) for s in stats.sessions),
        "groups": sorted(
            (
                g.group,
                g.sessions,
                g.indexed_pages,
                tuple(sorted((p.name, p.total_pages, p.free_pages) for p in g.pools)),
            )
            for g in stats.groups
        ),
        "backups": sorted((b.backup_id, b.session_id, b.pages) for b in stats.backups),
        "host_used_bytes": stats.host_used_bytes,
    }


def admin_target_of(target: str) -> str | None:
    """The admin socket next to a worker socket target (the daemon's default
    ``server.admin_socket``) when it exists; None for a TCP target."""
    if not target.startswith("unix:"):
        return None
    admin = Path(target.removeprefix("unix://").removeprefix("unix:")).parent / "admin.sock"
    return f"unix://{admin}" if admin.exists() else None


def state(client: HiCacheClient) -> dict[str, Any]:
    """:func:`snapshot` of the daemon behind ``client`` as its admin sees it: a worker's
    GetStats shows no pool groups (nor sessions), whose pages a "nothing changed" check must
    see. The client's own view where no admin socket is at hand (TCP)."""
    admin = admin_target_of(client.target)
    if admin is None:
        return snapshot(client.get_stats())
    with HiCacheClient(admin, timeout_s=30.0) as whole:
        return snapshot(whole.get_stats())


def poll(probe: Callable[[], T], done: Callable[[T], bool], timeout_s: float, what: str) -> T:
    """Call ``probe`` until ``done(result)``; AssertionError with the last result after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = probe()
        if done(result):
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s} s; last: {result!r}")
        time.sleep(0.05)  # poll interval of a deadline-bounded wait


def proc_bytes(pid: int, field: str) -> int:
    """A size of ``/proc/<pid>/status`` in bytes: ``VmRSS`` (resident), ``VmHWM`` (peak
    resident), ``VmSize`` (virtual)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def fd_links(pid: int) -> list[str]:
    """What each open descriptor of process ``pid`` refers to, sorted (one closed between the
    listing and its readlink is left out: the daemon's threads open and close as we look)."""
    links = []
    for f in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            links.append(os.readlink(f"/proc/{pid}/fd/{f}"))
    return sorted(links)


def memfd_mappings(pid: int, name: str = "") -> list[str]:
    """The lines of ``/proc/<pid>/maps`` that map a memfd whose name contains ``name``
    (``/memfd:NAME (deleted)``): a worker's handed-over buffers while the daemon maps them."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return [line for line in lines if "/memfd:" in line and name in line.partition("/memfd:")[2]]


def stop_process(pid: int) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped: the signal is delivered
    asynchronously, and a thread still running could take a request the test means to stall."""
    os.kill(pid, signal.SIGSTOP)

    def states() -> list[str]:
        found = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError):
                found.append(Path(f"/proc/{pid}/task/{task}/stat").read_text().rsplit(")", 1)[1].split()[0])
        return found

    poll(states, lambda s: bool(s) and all(x in ("T", "t") for x in s), 10.0, f"process {pid} stopped")
