"""Issue 9 item 7: the socket belongs to the daemon.

Attacks tried on main (each test fails there): a second daemon on a live socket
unlinked it and served in its place, leaving the first unreachable; a runtime
directory another user created (or anyone may write) was used as is; the
socket existed for a moment with umask permissions; stop unlinked whatever the
path named by then.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from hicached_client import HiCacheClient

from tests.security.roles_helpers import launch, one_line_error, other_user, scratch_dir, serve
from tests.support.daemon import Daemon


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = scratch_dir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    d = launch(scratch_dir())
    try:
        yield d
    finally:
        d.stop()


def ping(target: str) -> bytes:
    with HiCacheClient(target, timeout_s=10) as client:
        return client.ping(b"still here")


def test_a_second_daemon_on_a_live_socket_exits_2_naming_the_first(daemon: Daemon) -> None:
    """Before: the second daemon unlinked and rebound the socket; the first ran on unreachable."""
    sock = Path(daemon.target.removeprefix("unix://"))
    inode = os.lstat(sock).st_ino
    second = serve("--socket", str(sock))
    line = one_line_error(second)
    assert f"another hicached (pid {daemon.process.pid}) is serving on {sock}" in line, line
    assert os.lstat(sock).st_ino == inode, "the first daemon's socket was not replaced"
    assert ping(daemon.target) == b"still here"
    assert ping(daemon.admin_target) == b"still here"


def test_a_second_daemon_on_a_live_admin_socket_exits_2(daemon: Daemon, workdir: Path) -> None:
    admin = daemon.admin_target.removeprefix("unix://")
    second = serve("--socket", str(workdir / "other.sock"), "--set", f"server.admin_socket={admin}")
    line = one_line_error(second)
    assert f"another hicached (pid {daemon.process.pid}) is serving on {admin}" in line, line
    assert ping(daemon.admin_target) == b"still here"


def test_a_dead_daemons_socket_is_replaced() -> None:
    workdir = scratch_dir()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(workdir / "d.sock"))  # bound, never listening, closed: what a killed daemon leaves
    stale.close()
    d = launch(workdir)
    try:
        assert ping(d.target) == b"still here"
    finally:
        d.stop()


def test_a_file_that_is_not_a_socket_is_refused_and_kept(workdir: Path) -> None:
    victim = workdir / "d.sock"
    victim.write_text("precious")
    line = one_line_error(serve("--socket", str(victim)))
    assert f"{victim} exists and is not a socket" in line, line
    assert victim.read_text() == "precious"


def test_a_runtime_dir_owned_by_another_user_is_refused(workdir: Path) -> None:
    """Before: the daemon served from a directory another user created, who could swap the socket."""
    uid, gid = other_user()
    squatted = workdir / "run"
    squatted.mkdir(mode=0o755)
    os.chown(squatted, uid, gid)
    line = one_line_error(serve("--socket", str(squatted / "hicached.sock")))
    assert f"socket directory {squatted} is owned by uid {uid}" in line, line
    assert list(squatted.iterdir()) == [], "nothing was created in the squatted directory"


@pytest.mark.parametrize(("mode", "who"), [(0o777, "others"), (0o770, "its group")])
def test_a_runtime_dir_others_or_its_group_can_write_is_refused(workdir: Path, mode: int, who: str) -> None:
    """0770, its group: deploy/base made /run/hicached so with the workers in its group, and any
    worker could unlink admin.sock and the fd handoff socket and bind its own, then read and
    overwrite the KV buffers other workers handed over (accepted before; 0777 was refused)."""
    shared = workdir / "run"
    shared.mkdir()
    shared.chmod(mode)
    line = one_line_error(serve("--socket", str(shared / "hicached.sock")))
    assert f"socket directory {shared} is writable by {who} (mode {mode:04o})" in line, line
    assert list(shared.iterdir()) == []


def test_the_daemon_creates_its_runtime_dir_and_sockets_with_tight_modes(workdir: Path) -> None:
    run = workdir / "run"
    d = launch(workdir, "--set", "server.admin_socket=" + str(run / "a.sock"), sock=run / "hicached.sock")
    try:
        assert stat.S_IMODE(os.stat(run).st_mode) == 0o700
        assert stat.S_IMODE(os.lstat(run / "hicached.sock").st_mode) == 0o660  # server.socket_mode
        assert stat.S_IMODE(os.lstat(run / "a.sock").st_mode) == 0o600
        assert ping(f"unix://{run / 'a.sock'}") == b"still here"
    finally:
        d.stop()
    assert not (run / "hicached.sock").exists() and not (run / "a.sock").exists(), "stop removes its sockets"


@pytest.mark.parametrize("nested", [False, True], ids=["parent-exists", "parent-made-too"])
def test_an_admin_group_gets_a_0750_dir_and_a_0660_admin_socket(workdir: Path, nested: bool) -> None:
    """``parent-made-too``: a socket directory whose parent was missing skipped its mode and
    group (the admin group could not reach the admin socket)."""
    _, gid = other_user()
    run = workdir / "new" / "run" if nested else workdir / "run"
    d = launch(workdir, "--set", f"server.admin_group={gid}", sock=run / "hicached.sock")
    try:
        st_dir, st_admin = os.stat(run), os.lstat(run / "admin.sock")
        assert (stat.S_IMODE(st_dir.st_mode), st_dir.st_gid) == (0o750, gid)
        assert (stat.S_IMODE(st_admin.st_mode), st_admin.st_gid) == (0o660, gid)
    finally:
        d.stop()


def test_an_unknown_admin_group_is_refused(workdir: Path) -> None:
    line = one_line_error(
        serve("--socket", str(workdir / "d.sock"), "--set", "server.admin_group=no-such-group-x")
    )
    assert "server.admin_group = 'no-such-group-x': no such group" in line, line


def test_stop_unlinks_only_the_socket_it_created(daemon: Daemon) -> None:
    """Before: stop unlinked whatever the path named (another daemon's socket after a takeover)."""
    sock = Path(daemon.target.removeprefix("unix://"))
    sock.unlink()
    with contextlib.closing(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)) as usurper:
        usurper.bind(str(sock))
        usurper.listen(1)
        theirs = os.lstat(sock)
        daemon.process.terminate()
        assert daemon.process.wait(timeout=30) == 0
        assert sock.exists(), "the daemon left the socket it did not create"
        assert (os.lstat(sock).st_ino, os.lstat(sock).st_ctime_ns) == (theirs.st_ino, theirs.st_ctime_ns)
    assert not Path(daemon.admin_target.removeprefix("unix://")).exists(), "its own admin socket is gone"


# ---- a reviewer's takeovers of the socket paths (each test failed before) ---------------------


def test_a_socket_dir_reached_through_another_users_symlink_is_refused(workdir: Path) -> None:
    """A stranger's symlink named as the socket directory (in /tmp, say): the daemon served in
    the directory it pointed at, and the stranger re-pointed it at its own sockets at will."""
    uid, _ = other_user()
    real = workdir / "real"
    real.mkdir(mode=0o700)
    link = workdir / "run"
    link.symlink_to(real)
    os.lchown(link, uid, -1)
    line = one_line_error(serve("--socket", str(link / "hicached.sock")))
    assert f"{link} on its path is a symlink owned by uid {uid}" in line, line
    assert list(real.iterdir()) == []


def test_a_directory_of_another_user_above_the_socket_dir_is_refused(workdir: Path) -> None:
    """Whoever owns a directory on the way can rename the socket directory away and put its own."""
    uid, gid = other_user()
    theirs = workdir / "home"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, uid, gid)
    line = one_line_error(serve("--socket", str(theirs / "run" / "hicached.sock")))
    assert f"{theirs} on its path is a directory owned by uid {uid}" in line, line
    assert list(theirs.iterdir()) == []


@pytest.mark.parametrize("suffix", [".fds", ".lane"])
def test_a_file_at_the_handoff_or_lane_path_is_kept_and_refused(workdir: Path, suffix: str) -> None:
    """The handoff and lane sockets unlinked whatever their paths named at start."""
    run = workdir / "run"
    run.mkdir(mode=0o700)
    victim = run / f"hicached.sock{suffix}"
    victim.write_text("precious")
    line = one_line_error(serve("--socket", str(run / "hicached.sock")))
    assert f"{victim} exists and is not a socket" in line, line
    assert victim.read_text() == "precious"


def test_a_symlink_swapped_in_after_linking_is_never_chmodded(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reviewer's racer renamed a symlink to a root-only file over a socket the daemon had
    just linked into place, before its chmod by path: the file became 0666 in 3 of 6 starts.
    Here the racer always wins (a symlink replaces the public name as soon as it is linked);
    the mode is set through the private name, before the link, so nothing follows it."""
    from hicached.server.sockets import BoundSocket

    secret = workdir / "secret"
    secret.write_text("root only")
    secret.chmod(0o600)
    run = workdir / "run"
    run.mkdir(mode=0o700)
    link = os.link

    def link_then_swap(src: str | Path, dst: str | Path, **kw: bool) -> None:
        link(src, dst, **kw)
        os.unlink(dst)
        os.symlink(secret, dst)

    monkeypatch.setattr(os, "link", link_then_swap)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        BoundSocket.bind(listener, run / "w.sock", 0o666, "w")
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
