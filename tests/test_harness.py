"""The shared harness (``hicached.testing``) reports what it cannot do instead of hiding it:
a daemon that refuses to start is a :class:`DaemonDied` with its exit code and the end of its
log, and leaves nothing behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hicached.testing.daemon import DaemonDied, launch, scratch_dir


def test_a_daemon_that_refuses_to_start_is_reported_with_its_log_and_cleaned_up() -> None:
    mine = f"hcd-{os.getpid()}-*"  # scratch_dir's names: other processes make theirs meanwhile
    before = set(Path("/tmp").glob(mine))
    with pytest.raises(DaemonDied) as failed:
        launch("--l3", "none", "--set", "server.grace_s=not-a-number")
    message = str(failed.value)
    assert "exited with code 2 before it was ready" in message, message
    assert "server.grace_s" in message, message  # the end of the daemon's own output
    assert set(Path("/tmp").glob(mine)) <= before, "the scratch directory it made is removed"


def test_a_given_workdir_is_kept_and_its_log_names_the_start(tmp_path: Path) -> None:
    daemon = launch(
        "--l3", "none", "--host-budget", "64MiB", workdir=tmp_path, socket=scratch_dir() / "d.sock"
    )
    try:
        assert "event=started" in daemon.log
    finally:
        code = daemon.stop()
        daemon.socket.parent.rmdir()  # the daemon removed its sockets on the clean stop
    assert code == 0
    assert (tmp_path / "daemon.log").is_file()
