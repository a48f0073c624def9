"""A ``host.journal_dir`` another local user made or can re-point (review: warm restart).

The next daemon replays the journals it finds there, mapping the keys they list onto pages of
the segments they name: whoever can write the directory decides what other tenants get as
hits (/tmp/rev_warm/r3_foreign_journal_dir.py: a victim's never-written chain hit 8 pages of
8). Such a directory is refused at start (exit 2, one line naming the key), as is a path
through another user's directory or symlink; a symlink is never followed by the chmod.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hicached.core.journal import JournalStore
from hicached.errors import FailedPrecondition
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


@pytest.fixture
def base() -> Iterator[Path]:
    root = scratch_dir("hcjd")
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_name_made_at_journal_dir_between_its_check_and_its_use_is_refused(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails before: after its last check the directory was made (an existing name was taken
    as made) and opened through ``realpath``: another user's symlink dropped at the name in
    that moment (a sticky parent such as /tmp lets anyone make a name) was followed, and a
    root daemon narrowed the root-owned directory it pointed to to 0700 and kept its lock and
    journals there (the review's race hit in 5 tries). Here the stranger's symlink lands in the
    daemon's mkdir; the directory is judged again once it exists and opened as judged."""
    uid = other_user()
    victim = base / "victim"
    victim.mkdir(mode=0o755)
    journal_dir = base / "journals"
    real_mkdir = os.mkdir

    def mkdir_after_the_stranger(path: Any, mode: int = 0o777, **kwargs: Any) -> None:
        if Path(path) == journal_dir and not os.path.lexists(journal_dir):
            os.symlink(victim, journal_dir)
            os.lchown(journal_dir, uid, uid)
        real_mkdir(path, mode, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir_after_the_stranger)
    store = JournalStore(journal_dir, f"hcjd{uuid.uuid4().hex[:8]}", max_key_bytes=1024)
    with pytest.raises(FailedPrecondition) as info:
        store.lock()
    store.unlock()
    assert f"{journal_dir} on its path is a symlink owned by uid {uid}" in str(info.value), info.value
    assert stat.S_IMODE(victim.stat().st_mode) == 0o755, "the stranger's target was narrowed"
    assert not (victim / f"{store.prefix}.lock").exists()
