"""Credential files (TCP tokens, TLS key, the L3 secret) that other local users can write or read
(review: config and token files). Writable by its group or others: they choose the token (the
admin token gives every admin call), so the start is refused (exit 2, one line naming the key).
Readable by others: a warning in the log. A FIFO is refused instead of hanging the start.
Owned by a uid other than root and the daemon's, or where such a uid could replace it (its
directory or a symlink on its path is theirs, or its directory is writable by others without
the sticky bit): refused too, whatever the file's mode."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hicached_client.pathwalk import Walk

from hicached.config import ConfigError, L3Config
from hicached.server import credentials
from tests.daemon.conftest import free_port
from tests.security.users import other_user
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


def _one_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return lines[0]


def _secret(path: Path, mode: int = 0o400) -> Path:
    path.write_text("a-secret-of-the-test-" + "x" * 32 + "\n")
    path.chmod(mode)
    return path


@pytest.mark.parametrize("key", ["server.auth_token_file", "l3.auth_key_file"])
def test_a_credential_file_another_user_owns_is_refused(tmp_path: Path, key: str) -> None:
    """Fails before the fix: a 0600 file of another non-root uid was accepted (its owner may
    chmod it and write the token or secret of its choice)."""
    uid = other_user()
    secret = _secret(tmp_path / "secret", 0o600)
    os.chown(secret, uid, uid)
    token = _secret(tmp_path / "token")  # the TCP listener needs one
    args = ["--set", f"{key}={secret}"]
    if key != "server.auth_token_file":
        args += ["--set", f"server.auth_token_file={token}"]
    line = _one_line(_serve(tmp_path, *args))
    assert key in line and f"owned by uid {uid}" in line, line


def test_a_credential_file_in_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    """Fails before the fix: a 0400 token in a 0777 directory was accepted (anyone could
    rename it away and put their own token in its place)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    token = _secret(shared / "token")
    line = _one_line(_serve(tmp_path, "--set", f"server.auth_token_file={token}"))
    assert "server.auth_token_file" in line and "writable by others" in line and "sticky" in line, line


@pytest.mark.parametrize("via", ["directory", "symlink"])
def test_a_credential_file_another_user_could_repoint_is_refused(tmp_path: Path, via: str) -> None:
    """Fails before the fix: a root-owned 0400 token reached through another user's directory
    (or symlink) was accepted; its owner could swap in a file of its choice."""
    uid = other_user()
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    if via == "directory":
        os.chown(theirs, uid, uid)
        token = _secret(theirs / "token")
    else:
        token = theirs / "token"
        os.symlink(_secret(tmp_path / "real-token"), token)
        os.lchown(token, uid, uid)
    line = _one_line(_serve(tmp_path, "--set", f"server.auth_token_file={token}"))
    assert "server.auth_token_file" in line and f"owned by uid {uid}" in line and "on its path" in line, line


def test_a_credential_file_in_a_sticky_directory_is_accepted(tmp_path: Path) -> None:
    """A 1777 directory, as /tmp or a Kubernetes Secret volume's mount: only a file's owner (here
    root) may rename or remove it there, so the daemon starts."""
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    token = _secret(sticky / "token")
    daemon = start_daemon("--listen", f"127.0.0.1:{free_port()}", "--set", f"server.auth_token_file={token}")
    daemon.stop()


@pytest.mark.parametrize("form", ["link/..", "a symlink half-way"])
def test_a_credential_path_the_kernel_resolves_through_another_users_entries_is_refused(
    tmp_path: Path, form: str
) -> None:
    """Fails before: the check judged the path as text and as ``realpath``, not as the kernel
    walks it. ``etc/link/..`` is the parent of what ``link`` points to (another user's ``evil``),
    and a root-owned ``etc/token`` -> ``evil/hop`` -> a root-owned file passes through
    ``evil`` and its symlink ``hop`` on neither path: the review's repro read a token of the
    other user's choice ("Linux", from a root-owned /proc file its symlink pointed to)."""
    uid = other_user()
    etc, evil = tmp_path / "etc", tmp_path / "evil"
    etc.mkdir()
    (evil / "sub").mkdir(parents=True)
    for path in (evil, evil / "sub"):
        os.chown(path, uid, uid)
    real = _secret(tmp_path / "real-token")
    if form == "link/..":
        os.symlink(evil / "sub", etc / "link")
        shutil.copy(real, evil / "token")  # root's and 0400: only its directory is theirs
        token = f"{etc}/link/../token"
    else:
        os.symlink(real, evil / "hop")
        os.lchown(evil / "hop", uid, uid)
        os.symlink(evil / "hop", etc / "token")
        token = str(etc / "token")
    line = _one_line(_serve(tmp_path, "--set", f"server.auth_token_file={token}"))
    assert "server.auth_token_file" in line and f"{evil} on its path" in line and f"uid {uid}" in line, line


def test_a_credential_file_below_a_directory_others_can_write_is_refused(tmp_path: Path) -> None:
    """Fails before: only the directory holding the file was judged by its write bits, those
    above by owner only. Anyone who can write ``shared`` (root's, 0777, not sticky) can swap
    ``sec`` for a directory of theirs and back (``renameat2(RENAME_EXCHANGE)``): the review's
    race read a token of its choice in about 2 % of starts. Now every directory on the way is
    judged, before the file is read."""
    sec = tmp_path / "shared" / "sec"
    sec.mkdir(parents=True)
    sec.parent.chmod(0o777)
    token = _secret(sec / "token")
    line = _one_line(_serve(tmp_path, "--set", f"server.auth_token_file={token}"))
    assert f"{sec.parent} on its path is writable by others" in line and "sticky" in line, line


def test_the_path_is_judged_by_the_walk_that_finds_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails before: owners were judged by one walk and the file found by a second. A path
    missing at the first (its parts were skipped, nothing to judge) and present at the second
    (a stranger renaming its directory into place, in a loop) was never judged by owner: the
    review's race took /etc/machine-id, readable by every local user, as the admin token (79
    of 30,640 tries). Here the stranger's rename lands just before the credentials' walk."""
    uid = other_user()
    known = _secret(tmp_path / "known", 0o444)  # root's, readable by all: like /etc/machine-id
    ready = tmp_path / "cred.x"
    ready.mkdir()
    (ready / "key").symlink_to(known)
    os.lchown(ready / "key", uid, uid)
    os.chown(ready, uid, uid)
    path = tmp_path / "cred" / "key"
    real_walk = credentials.walk

    def walk_after_the_rename(at: str) -> Walk:
        if not (tmp_path / "cred").exists():
            ready.rename(tmp_path / "cred")
        return real_walk(at)

    monkeypatch.setattr(credentials, "walk", walk_after_the_rename)
    with pytest.raises(ConfigError) as info:
        credentials.load_l3_key(L3Config(auth_key_file=str(path)))
    assert f"{tmp_path / 'cred'} on its path is a directory owned by uid {uid}" in str(info.value), info.value
