"""Ownership records another local user leaves in the shared ``/dev/shm`` (review: startup).

``/dev/shm`` is 1777 on a plain host: any uid may create ``<prefix>-<id>.owner`` there. Such a
record is not the daemon's: a FIFO one hung every daemon of the prefix in ``reclaim_dead``'s
``open`` (root or not, warm restart or not), and the daemon must neither follow it nor remove
the files it names.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.security.users import other_user, run_as_other
from tests.support.daemon import start_daemon

SHM = Path("/dev/shm")


@pytest.fixture
def prefix() -> Iterator[str]:
    p = f"hcor{uuid.uuid4().hex[:8]}"
    yield p
    for path in SHM.glob(f"{p}*"):
        path.unlink()


def _as_other(code: str) -> None:
    result = run_as_other(code)
    assert result.returncode == 0, result.stderr[-2000:]


def test_fifo_ownership_record_of_another_user_does_not_hang_startup(prefix: str) -> None:
    """Fails before the fix: the daemon blocks for good in reclaim_dead's open() of the FIFO
    (not serving within 30 s; /tmp/rev_warm/r4_owner_fifo.sh)."""
    other_user()
    _as_other(f"import os; os.mkfifo('/dev/shm/{prefix}-dead1.owner')")
    _as_other(f"import os; os.close(os.open('/dev/shm/{prefix}-dead2.owner', os.O_CREAT | os.O_WRONLY, 0))")
    _as_other(f"open('/dev/shm/{prefix}-dead2-{'0' * 16}-kv', 'wb').close()")
    daemon = start_daemon("--set", f"host.shm_prefix={prefix}", timeout_s=30)
    try:
        assert "ignoring ownership record" in daemon.log, daemon.log[-3000:]
        # Another user's files are left alone, even by a root daemon.
        assert {p.name for p in SHM.glob(f"{prefix}-dead*")} == {
            f"{prefix}-dead1.owner",
            f"{prefix}-dead2.owner",
            f"{prefix}-dead2-{'0' * 16}-kv",
        }
    finally:
        daemon.stop()
