"""A pool group whose build fails leaves the daemon as it was: no group retired, nothing leaked.

Before, making room for a new group took the idle groups it retired out of the registry first,
and closed them only after the new group was built: a build that failed (a pool name that
cannot be part of a segment name, say) left them out of the registry and never closed, with
their /dev/shm segments, memory maps and two index I/O threads each (after 200 good and bad
attaches under ``host.max_groups=2``: 417 threads and 857 MB of segments, while GetStats said
4.3 MB were used). And a group whose content index could not be made kept its pools mapped and
its segments in /dev/shm.
"""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
from hicached_client import HiCacheClient, HiCacheError, WorkerIdentity, pool_spec
from hicached_client.v1 import types_pb2 as tpb

from tests.robustness.loop_support import HOST_PAGES, PAGE_BYTES, attach_bytes
from tests.support.daemon import Daemon, start_daemon
from tests.support.faults import serve_patched
from tests.support.state import state

# Each passes limits.max_identity_bytes (256) and cannot be part of a segment name: a '/', too
# many characters, too many bytes (120 characters, 240 UTF-8 bytes: before, the file system
# refused its segment's name, INTERNAL).
BAD_NAMES = ("a/b", "p" * 170, "é" * 120, "nul\0")
ROUNDS = 20


def named_spec(name: str) -> tpb.PoolSpec:
    return pool_spec(
        name, role="anchor", kind="mha", dtype="bfloat16", page_size=16, num_layers=2, num_heads=8,
        head_dim=64, host_layout="layer_first", k_buffers=(), v_buffers=(),
        host_bytes=HOST_PAGES * PAGE_BYTES,
    )  # fmt: skip


def held(d: Daemon) -> tuple[int, int, int]:
    """The daemon's threads, and its prefix's /dev/shm files and their bytes."""
    files = list(Path("/dev/shm").glob(f"{d.shm_prefix}*"))
    return len(os.listdir(f"/proc/{d.process.pid}/task")), len(files), sum(f.stat().st_size for f in files)


def test_a_refused_pool_name_retires_nothing_and_leaks_nothing() -> None:
    """Good and bad attaches of new models under host.max_groups=2: each good one retires the
    least recently used idle group; each bad one is INVALID_ARGUMENT naming the rule, before
    anything is retired (GetStats exactly as before it). Before the fix every bad attach leaked
    the group it retired: +1 segment and +2 threads per round."""
    d = start_daemon("--set", "host.max_groups=2")
    try:
        with HiCacheClient(d.target) as client, HiCacheClient(d.admin_target) as admin:
            for i in range(2):
                attach_bytes(client, f"m-seed-{i}").detach()
            threads, files, nbytes = held(d)
            for i in range(ROUNDS):
                attach_bytes(client, f"m-good-{i}").detach()
                before = state(admin)
                bad = BAD_NAMES[i % len(BAD_NAMES)]
                with pytest.raises(HiCacheError) as refused:
                    client.attach(
                        WorkerIdentity(f"w-bad-{i}", 1, f"m-bad-{i}"), [named_spec(bad)], heartbeat=False
                    )
                assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT, refused.value
                message = refused.value.message
                # A NUL is refused by the printable rule of every name, earlier still.
                rule = "must be printable" if "\0" in bad else "cannot be part of a host segment name"
                assert rule in message and len(message) < 300, message
                assert state(admin) == before, f"round {i}: a refused attach changed the daemon"
                now = held(d)
                # Threads: a few lazily started pool threads at most (before: +2 per round).
                assert now[0] <= threads + 3 and now[1:] == (files, nbytes), (
                    i,
                    (threads, files, nbytes),
                    now,
                )
            assert len(admin.get_stats().groups) == 2
    finally:
        d.stop()


# The content index of some models cannot be made (as when no thread can be started).
NO_INDEX = """
import hicached.daemon as daemon
_attach_index = daemon.Daemon._attach_index
def attach_index(self, state):
    if state.model_name.startswith("m-noindex"):
        raise RuntimeError("can't start new thread (test)")
    _attach_index(self, state)
daemon.Daemon._attach_index = attach_index
"""


def test_a_group_without_its_index_is_closed_and_unlinked() -> None:
    """Before the fix each failed attach left its new group's pools mapped and their segment in
    /dev/shm (+1 file and 4 MiB per attach), outside the registry and the budget."""
    d = serve_patched(NO_INDEX, "--set", "host.max_groups=2")
    try:
        with HiCacheClient(d.target) as client, HiCacheClient(d.admin_target) as admin:
            attach_bytes(client, "m-kept").detach()
            before, (threads, files, nbytes) = state(admin), held(d)
            for i in range(ROUNDS // 2):
                with pytest.raises(HiCacheError) as failed:
                    attach_bytes(client, f"m-noindex-{i}")
                assert failed.value.code == grpc.StatusCode.INTERNAL, failed.value
                now = held(d)
                assert now[0] <= threads + 3 and now[1:] == (files, nbytes), (
                    i,
                    (threads, files, nbytes),
                    now,
                )
            assert state(admin) == before
            attach_bytes(client, "m-after").detach()  # still serves new groups
    finally:
        d.stop()
