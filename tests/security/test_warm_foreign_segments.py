"""Files another local user leaves in the shared ``/dev/shm`` under a warm-restart name
(review: warm restart).

``/dev/shm`` is 1777 on a plain host: any uid may create ``<prefix>-<16 hex>-<pool>``. Such a
file is not the daemon's: it must not stop the daemon from starting (a non-root daemon's
unlink of it raised EPERM), count against the host budget (a sparse 1 TiB one evicted a
journaled group), or be removed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hicached_client import HiCacheClient, TokenChain, WorkerIdentity

from hicached.testing.daemon import scratch_dir, wait_serving
from hicached.testing.procs import child_env
from tests.daemon.conftest import stop_with
from tests.security.users import _as_other_prefix, _env, other_user, run_as_other
from tests.support.kv import PAGE_SIZE, WorkerPools, transfers, unique_tag
from tests.support.warm import Warm

SHM = Path("/dev/shm")
THIRD_UID = 54321  # a local user other than the daemon's (root makes its file and hands it over)
N = 8


@pytest.fixture
def prefix() -> Iterator[str]:
    p = f"hcfs{uuid.uuid4().hex[:8]}"
    yield p
    for path in SHM.glob(f"{p}*"):
        path.unlink()


def test_non_root_warm_daemon_starts_past_another_users_segment(prefix: str) -> None:
    """Fails before the fix: the daemon (uid hicached-sec) exits with PermissionError from
    unlinking the planted file in the sticky /dev/shm (/tmp/rev_warm/r1_planted_shm_nonroot.sh)."""
    other_user()
    planted = SHM / f"{prefix}-0123456789abcdef-kv"
    planted.write_bytes(b"")
    os.chown(planted, THIRD_UID, THIRD_UID)
    workdir = scratch_dir("hcfs")
    subprocess.run(["chown", "-R", "hicached-sec", str(workdir)], check=True)
    env = _env()
    env["PYTHONPATH"] = child_env()["PYTHONPATH"]  # the hicached this process runs
    log_path = workdir / "daemon.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [*_as_other_prefix(), sys.executable, "-m", "hicached", "serve", "--socket",
             str(workdir / "d.sock"), "--l3", "none", "--host-budget", "64MiB",
             "--set", "host.warm_restart=true", "--set", f"host.journal_dir={workdir / 'journal'}",
             "--set", f"host.shm_prefix={prefix}"],
            cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    try:
        try:
            wait_serving(f"unix://{workdir / 'd.sock'}", process, 30)
        except Exception as exc:
            raise AssertionError(log_path.read_text(errors="replace")[-3000:]) from exc
        text = log_path.read_text(errors="replace")
        assert f"ignoring /dev/shm/{planted.name}" in text, text[-3000:]
        assert planted.exists()
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
        subprocess.run(["rm", "-rf", str(workdir)], check=False)


def test_sparse_file_of_another_user_does_not_evict_a_journaled_group(warm: Warm) -> None:
    """Fails before the fix: the daemon counts the planted file's 1 TiB against host.budget and
    drops the journaled group at startup: the tenant's pages come back cold, 0 hits
    (/tmp/rev_warm/r2_sparse_squatter.py)."""
    other_user()
    pools = WorkerPools.create(unique_tag("plant"))
    ident = WorkerIdentity(unique_tag("w"), generation=1, model_name="m-plant")
    chain = TokenChain(list(range(N * PAGE_SIZE)), cache_salt="tenant-plant")
    try:
        first = warm.start()
        with HiCacheClient(first.target, timeout_s=30) as client:
            session = client.attach(ident, pools.specs(), heartbeat=False)
            gid = session.info.pools[0].segment[len(warm.prefix) + 1 :][:16]  # a worker sees it
            assert session.put_pages(chain, transfers(range(N))).stored_pages == N
            session.detach()
        assert stop_with(first, signal.SIGTERM) == 0
        planted = SHM / f"{warm.prefix}-{gid}-zz"
        result = run_as_other(f"f = open({str(planted)!r}, 'wb'); f.truncate(1 << 40); f.close()")
        assert result.returncode == 0, result.stderr[-2000:]
        second = warm.start()
        try:
            with HiCacheClient(second.target, timeout_s=30) as client:
                session = client.attach(ident, pools.specs(), heartbeat=False)
                assert session.info.joined_existing_group, second.log[-3000:]
                assert session.lookup(chain).l2_hit_pages == N
                session.detach()
            assert "dropped journaled" not in second.log
            assert planted.exists(), "another user's file is not the daemon's to remove"
        finally:
            second.stop()
    finally:
        pools.close()
