"""Two warm-restart daemons with one ``host.shm_prefix`` and two ``host.journal_dir``s.

The journal lock lives in the journal directory, so both started, and the second unlinked the
first one's live segments as "left without a journal" (/tmp/rev_warm/r7_two_daemons_one_prefix.py),
then built its own under the same names: the first one's journals would have named them at
its next clean stop. The second now refuses to start (exit 2, one line), holding nothing; a
lock file another user planted in /dev/shm is logged and ignored, never a reason not to start.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hicached_client import HiCacheClient, WorkerIdentity

from hicached.testing.daemon import scratch_dir
from hicached.testing.procs import child_env
from tests.security.users import other_user, run_as_other
from tests.support.kv import WorkerPools, unique_tag
from tests.support.warm import Warm


def test_second_daemon_of_a_prefix_with_another_journal_dir_is_refused(warm: Warm, tmp_path: Path) -> None:
    """Fails before the fix: the second daemon serves, and the first one's segments are gone."""
    pools = WorkerPools.create(unique_tag("twin"))
    first = warm.start()
    try:
        with HiCacheClient(first.target, timeout_s=30) as client:
            session = client.attach(
                WorkerIdentity(unique_tag("w"), generation=1, model_name="m-twin"), pools.specs()
            )
            segments = [p.segment for p in session.info.pools]
            workdir = scratch_dir("hctw")
            try:
                result = subprocess.run(
                    [sys.executable, "-m", "hicached", "serve", "--socket", str(workdir / "d.sock"),
                     "--l3", "none", "--host-budget", "64MiB", "--set", "host.warm_restart=true",
                     "--set", f"host.journal_dir={tmp_path / 'other-journals'}",
                     "--set", f"host.shm_prefix={warm.prefix}"],
                    cwd=workdir, env=child_env(clean=True), capture_output=True, text=True, timeout=30,
                    check=False,
                )  # fmt: skip
            finally:
                subprocess.run(["rm", "-rf", str(workdir)], check=False)
            assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
            last = result.stderr.strip().splitlines()[-1]
            assert last.startswith("hicached: ") and "another daemon uses warm-restart prefix" in last, last
            assert all(os.path.exists(f"/dev/shm/{name}") for name in segments), "a live segment was unlinked"
            assert session.lookup(["k" * 16]).l2_hit_pages == 0  # the first daemon still serves
            session.detach()
    finally:
        first.stop()
        pools.close()


def test_a_prefix_lock_another_user_planted_does_not_stop_the_daemon(warm: Warm) -> None:
    other_user()
    lock = f"/dev/shm/{warm.prefix}.warm.lock"
    result = run_as_other(f"import os; os.close(os.open({lock!r}, os.O_CREAT | os.O_WRONLY, 0o600))")
    assert result.returncode == 0, result.stderr[-2000:]
    daemon = warm.start()
    try:
        assert "warm-restart prefix lock" in daemon.log and "not used" in daemon.log, daemon.log[-3000:]
    finally:
        daemon.stop()
    assert os.stat(lock).st_uid != 0, "another user's file is left alone"
