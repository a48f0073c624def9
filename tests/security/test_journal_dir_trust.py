"""A ``host.journal_dir`` another local user made or can re-point (review: warm restart).

The next daemon replays the journals it finds there, mapping the keys they list onto pages of
the segments they name: whoever can write the directory decides what other tenants get as
hits (/tmp/rev_warm/r3_foreign_journal_dir.py: a victim's never-written chain hit 8 pages of
8). Such a directory is refused at start (exit 2, one line naming the key), as is a path
through another user's directory or symlink; a symlink is never followed by the chmod.
"""

from __future__ import annotations

import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicached.testing.daemon import scratch_dir
from hicached.testing.procs import child_env
from tests.security.users import other_user, run_as_other


def _as_other(code: str) -> None:
    result = run_as_other(code)
    assert result.returncode == 0, result.stderr[-2000:]


def _serve(journal_dir: Path) -> subprocess.CompletedProcess[str]:
    workdir = scratch_dir("hcjd")
    try:
        return subprocess.run(
            [sys.executable, "-m", "hicached", "serve", "--socket", str(workdir / "d.sock"), "--l3", "none",
             "--host-budget", "64MiB", "--set", f"host.shm_prefix=hcjd{uuid.uuid4().hex[:8]}",
             "--set", "host.warm_restart=true", "--set", f"host.journal_dir={journal_dir}"],
            cwd=workdir, env=child_env(clean=True), capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    finally:
        subprocess.run(["rm", "-rf", str(workdir)], check=False)


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A 1777 directory, as /tmp: any user may create names in it."""
    path = scratch_dir("hcjd")
    path.chmod(0o1777)
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


def test_journal_dir_another_user_made_is_refused(shared_tmp: Path) -> None:
    """Fails before the fix: the daemon used the other user's 0777 directory and served
    (the subprocess's 30 s timeout)."""
    other_user()
    journal_dir = shared_tmp / "journals"
    _as_other(f"import os; os.mkdir({str(journal_dir)!r}); os.chmod({str(journal_dir)!r}, 0o777)")
    result = _serve(journal_dir)
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("hicached: ") and "host.journal_dir" in last and "owned by uid" in last, last
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert not list(journal_dir.iterdir()), "nothing is written into it"


def test_journal_dir_symlink_of_another_user_is_refused_and_not_followed(shared_tmp: Path) -> None:
    """Fails before the fix: the daemon (root) followed the symlink and narrowed the root-owned
    0755 directory it points to to 0700 (with /tmp as the target, /tmp)."""
    other_user()
    target = shared_tmp / "victim"
    target.mkdir()
    target.chmod(0o755)
    link = shared_tmp / "journals"
    _as_other(f"import os; os.symlink({str(target)!r}, {str(link)!r})")
    result = _serve(link)
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "host.journal_dir" in result.stderr.strip().splitlines()[-1], result.stderr[-3000:]
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    assert not list(target.iterdir())
