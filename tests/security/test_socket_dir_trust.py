"""The worker's gRPC channel goes only to a socket that only trusted uids could have put there.

The fd handoff and the fast lane ask the kernel who listens (``SO_PEERCRED``); a gRPC channel
cannot. Before, a stranger's uid that owned the socket directory (a squatted
``/tmp/hicached-<uid>``) received every call: the worker's bearer token (``authorization``
metadata) and its Attach, and a byte-only session (no fds to hand over) attached to it and
took its answers as the daemon's. The client now checks the directory before its first call,
as the daemon does before it binds there: owned by root, this uid or ``$HICACHED_DAEMON_UID``,
not writable by its group or others, and every directory above owned by one of them.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from hicached_client import HiCacheClient, HiCacheError, WorkerIdentity

from tests.security.roles_helpers import launch, scratch_dir
from tests.security.users import other_user, popen_as_other

# A stranger's listener at the gRPC path: prints how many bytes it received before the test's END.
STRANGER = r"""
import socket, sys
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(sys.argv[1])
srv.listen(8)
print("ready", flush=True)
total = 0
while True:
    conn, _ = srv.accept()
    conn.settimeout(2)
    got = b""
    try:
        while chunk := conn.recv(65536):
            got += chunk
            if got == b"END":
                break
    except OSError:
        pass
    if got == b"END":
        break
    total += len(got)
print(total, flush=True)
"""


@pytest.fixture
def base() -> Iterator[Path]:
    root = scratch_dir()
    root.chmod(0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _call_stranger(
    run: Path,
    *,
    wait_ready: bool = False,
    target: str | None = None,
    before: Callable[[], None] = lambda: None,
) -> tuple[HiCacheError, int]:
    """A byte-only attach with a token against a stranger listening at ``run/hicached.sock``
    (the client's target that socket unless ``target`` names it otherwise; ``before`` runs once
    the stranger listens), after ``client.wait_ready`` when ``wait_ready``: (the error, bytes
    the stranger received)."""
    sock = run / "hicached.sock"
    stranger = popen_as_other(STRANGER, str(sock))
    try:
        assert stranger.stdout is not None
        assert stranger.stdout.readline().strip() == "ready"
        before()
        with (
            HiCacheClient(target or f"unix://{sock}", token="worker-token", timeout_s=3) as client,
            pytest.raises(HiCacheError) as info,
        ):
            if wait_ready:
                client.wait_ready(3)
            client.attach(WorkerIdentity("w"), [], heartbeat=False)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as end:  # unblocks an idle stranger
            end.connect(str(sock))
            end.sendall(b"END")
        out, _ = stranger.communicate(timeout=30)
    finally:
        if stranger.poll() is None:
            stranger.kill()
            stranger.wait()
    return info.value, int(out.split()[-1])


@pytest.mark.parametrize("wait_ready", [False, True])
def test_a_strangers_socket_directory_gets_nothing(base: Path, wait_ready: bool) -> None:
    """With ``wait_ready`` it fails before wait_ready ran the check: the channel connected to the
    stranger (who got the HTTP/2 preface) and a later call, once the stranger had put a
    trusted directory in its place, went over that connection."""
    uid = other_user()
    run = base / "run"
    run.mkdir()
    os.chown(run, uid, -1)
    err, received = _call_stranger(run, wait_ready=wait_ready)
    assert err.code == grpc.StatusCode.PERMISSION_DENIED, err
    assert f"owned by uid {uid}" in err.message and "HICACHED_DAEMON_UID" in err.message
    assert received == 0, f"the stranger got {received} bytes of the worker's calls"


@pytest.mark.parametrize("form", ["link/..", "socket symlink"])
def test_a_trusted_path_the_kernel_resolves_into_a_strangers_directory_gets_nothing(
    base: Path, form: str
) -> None:
    """Fails before: the check judged ``link/..`` as text (``trusted``, root's) where the kernel
    goes to the parent of what ``link`` points to (the stranger's ``evil``), and it never looked
    at the socket's own name, a root-owned symlink into ``evil``: the stranger received the
    worker's token and Attach (459 bytes in the review's repro). Now the walk is the kernel's."""
    uid = other_user()
    evil, trusted = base / "evil", base / "trusted"
    (evil / "sub").mkdir(parents=True)
    for path in (evil, evil / "sub"):
        os.chown(path, uid, -1)
    trusted.mkdir()
    (trusted / "link").symlink_to(evil / "sub")
    if form == "link/..":
        target, before = f"unix://{trusted}/link/../hicached.sock", lambda: None
    else:
        target = f"unix://{trusted}/hicached.sock"

        def before() -> None:
            (trusted / "hicached.sock").symlink_to(evil / "hicached.sock")

    err, received = _call_stranger(evil, target=target, before=before)
    assert err.code == grpc.StatusCode.PERMISSION_DENIED, err
    assert f"{evil}, on the way" in err.message and f"owned by uid {uid}" in err.message
    assert received == 0, f"the stranger got {received} bytes of the worker's calls"


def test_a_socket_directory_others_can_write_gets_nothing(base: Path) -> None:
    run = base / "run"
    run.mkdir()
    run.chmod(0o777)  # the stranger can put its socket in a directory root owns
    err, received = _call_stranger(run)
    assert err.code == grpc.StatusCode.PERMISSION_DENIED, err
    assert "writable by its group or others" in err.message
    assert "there is no socket" not in err.message  # the stranger's is there
    assert received == 0, f"the stranger got {received} bytes of the worker's calls"


def test_hicached_daemon_uid_names_the_daemons_user(base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the daemon runs as its own user (deploy/base: uid 10001), the workers name it."""
    uid = other_user()
    monkeypatch.setenv("HICACHED_DAEMON_UID", str(uid))
    run = base / "run"
    run.mkdir()
    os.chown(run, uid, -1)
    err, received = _call_stranger(run)
    assert err.code != grpc.StatusCode.PERMISSION_DENIED, err
    assert received > 0, "the named uid's directory is trusted"


def test_a_socket_path_that_cannot_be_read_is_unavailable(base: Path) -> None:
    """Fails before: a parent that is a file raised a bare NotADirectoryError from the call."""
    afile = base / "afile"
    afile.write_text("x")
    with (
        HiCacheClient(f"unix://{afile}/run/hicached.sock", timeout_s=3) as client,
        pytest.raises(HiCacheError) as info,
    ):
        client.ping()
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert "cannot check the daemon's socket directory" in info.value.message


def test_a_trusted_symlink_into_a_strangers_directory_gets_nothing(base: Path) -> None:
    """Fails before: the path was judged as written only. ``link`` (root's) resolves to
    ``evil/run`` (root's, 0755) inside ``evil``, which a stranger owns and can rename ``run``
    out of and put its own socket directory in place of; the call went ahead."""
    uid = other_user()
    evil = base / "evil"
    (evil / "run").mkdir(parents=True)
    os.chown(evil, uid, -1)
    (base / "link").symlink_to(evil / "run")
    with (
        HiCacheClient(f"unix://{base / 'link' / 'hicached.sock'}", timeout_s=3) as client,
        pytest.raises(HiCacheError) as info,
    ):
        client.ping()
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED, info.value
    assert f"{evil}, on the way" in info.value.message and f"owned by uid {uid}" in info.value.message


@pytest.mark.parametrize("wait_ready", [False, True])
def test_a_missing_socket_directory_is_refused_by_name(base: Path, wait_ready: bool) -> None:
    """Fails before: a directory missing at check time passed as nothing to judge and the call
    went ahead to connect (whoever made the directory in between got the connection); it is
    UNAVAILABLE now, naming the directory, and nothing connects (``wait_ready`` says so once
    its time is up)."""
    missing = base / "not-yet"
    with (
        HiCacheClient(f"unix://{missing / 'hicached.sock'}", timeout_s=3) as client,
        pytest.raises(HiCacheError) as info,
    ):
        if wait_ready:
            client.wait_ready(0.2)
        client.ping()
    assert info.value.code == grpc.StatusCode.UNAVAILABLE, info.value
    assert f"socket directory {missing} does not exist" in info.value.message


def test_wait_ready_waits_for_the_directory_a_starting_daemon_makes(base: Path) -> None:
    """A worker may wait for a daemon that has not made its socket directory yet: ``wait_ready``
    looks for the directory again until its time is up, then connects (after the first fix it
    failed at once, the directory being missing when it was called)."""
    sock = base / "later" / "d.sock"
    errors: list[BaseException] = []
    with HiCacheClient(f"unix://{sock}", timeout_s=60) as client:

        def wait() -> None:
            try:
                client.wait_ready(60)
            except BaseException as exc:  # handed to the test's thread
                errors.append(exc)

        waiter = threading.Thread(target=wait)
        waiter.start()  # the daemon's interpreter takes far longer to start than this thread
        (base / "later-work").mkdir()
        daemon = launch(base / "later-work", sock=sock)
        try:
            waiter.join(60)
            assert not waiter.is_alive() and errors == [], errors
            assert client.ping(b"x") == b"x"
        finally:
            daemon.stop()


def test_a_socket_directory_this_user_may_not_enter_is_permission_denied(base: Path) -> None:
    """Fails before (a review of stop 46): a user pointing at another user's daemon (its socket
    directory 0700) got UNAVAILABLE with no hint. Now it is PERMISSION_DENIED saying whose way
    in it is. The check runs in a child forked as the test user (no exec: the interpreter's
    capabilities would let it search any directory)."""
    uid = other_user()
    run = base / "private"
    run.mkdir(mode=0o700)
    target = f"unix://{run}/hicached.sock"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            from hicached_client._handoff import check_socket_dir

            try:
                check_socket_dir(target)
                os.write(write, b"passed")
            except HiCacheError as exc:
                os.write(write, f"{exc.code.name} {exc.message}".encode())
        except BaseException:
            code = 1
        os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        said = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, said
    assert said.startswith("PERMISSION_DENIED this user may not enter the daemon's socket directory"), said
    assert str(run) in said and "server.socket_mode" in said, said
