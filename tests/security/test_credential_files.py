"""Credential files (TCP tokens, TLS key, the L3 secret) that other local users can write or read
(review: config and token files). Writable by its group or others: they choose the token (the
admin token gives every admin call), so the start is refused (exit 2, one line naming the key).
Readable by others: a warning in the log. A FIFO is refused instead of hanging the start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemon.conftest import free_port
from tests.support.daemon import ROOT, start_daemon


def _serve(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hicached", "serve", "--socket", str(tmp_path / "d.sock"), "--l3", "none",
         "--listen", f"127.0.0.1:{free_port()}", *args],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=30,
    )  # fmt: skip


@pytest.mark.parametrize(("key", "mode"), [("auth_token_file", 0o666), ("admin_token_file", 0o620)])
def test_a_token_file_others_or_its_group_can_write_is_refused(tmp_path: Path, key: str, mode: int) -> None:
    """Fails before the fix: the daemon started (and served until the 30 s timeout)."""
    token = tmp_path / "token"
    token.write_text("a-token-for-the-test\n")
    token.chmod(mode)
    other = tmp_path / "other-token"
    other.write_text("another-token-for-the-test\n")
    other.chmod(0o600)
    files = {key: token, ("admin_token_file" if key == "auth_token_file" else "auth_token_file"): other}
    result = _serve(tmp_path, *[a for k, p in files.items() for a in ("--set", f"server.{k}={p}")])
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"server.{key}" in lines[0] and "writable by" in lines[0], result.stderr


def test_a_fifo_token_file_is_refused(tmp_path: Path) -> None:
    """Fails before the fix: the start blocked in the read (the 30 s timeout)."""
    fifo = tmp_path / "token"
    os.mkfifo(fifo, 0o600)
    result = _serve(tmp_path, "--set", f"server.auth_token_file={fifo}")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "not a regular file" in result.stderr.strip().splitlines()[-1], result.stderr


def test_a_token_file_others_can_read_is_warned_about(tmp_path: Path) -> None:
    """Fails before the fix: no word in the log."""
    token = tmp_path / "token"
    token.write_text("a-token-for-the-test\n")
    token.chmod(0o644)
    daemon = start_daemon("--listen", f"127.0.0.1:{free_port()}", "--set", f"server.auth_token_file={token}")
    try:
        assert "server.auth_token_file" in daemon.log and "readable by others" in daemon.log, daemon.log[
            -3000:
        ]
    finally:
        daemon.stop()
