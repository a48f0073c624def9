"""The client hands its buffers only to a daemon it trusts.

A reviewer's stranger squatted the default ``/tmp/hicached-<uid>`` of another user (and, where
a group could write the socket directory, replaced ``hicached.sock.fds``): the victim's worker
sent its memfds to the stranger's listener, which read the KV in them and wrote into it. The
client now checks who listens (``SO_PEERCRED``) before sending a descriptor: root, its own uid,
or ``$HICACHED_DAEMON_UID``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hicached_client import HiCacheClient, HiCacheError, WorkerIdentity

from tests.security.roles_helpers import scratch_dir
from tests.security.users import other_user, popen_as_other
from tests.support.kv import WorkerPools, unique_tag

# A stranger's listener at the handoff path: it reports how many descriptors it was sent.
FAKE = r"""
import socket, sys
path = sys.argv[1]
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(path)
srv.listen(1)
print("ready", flush=True)
conn, _ = srv.accept()
conn.settimeout(10)
try:
    _, fds, _, _ = socket.recv_fds(conn, 64, 16)
except OSError:
    fds = []
print(f"fds {len(fds)}", flush=True)
"""


@pytest.fixture
def squatted() -> Iterator[Path]:
    """A socket directory a second uid owns, as a squatted default path would be."""
    uid = other_user()
    base = scratch_dir()
    base.chmod(0o755)  # whatever the umask: the stranger reaches its directory
    run = base / "run"
    run.mkdir()
    os.chown(run, uid, -1)
    try:
        yield run
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _attach_to_stranger(run: Path) -> tuple[HiCacheError, int]:
    """Attach with real memfd pools against the stranger's listener: (the error, fds it got)."""
    fake = popen_as_other(FAKE, str(run / "hicached.sock.fds"))
    pools = WorkerPools.create(unique_tag("peer"))
    try:
        assert fake.stdout is not None
        assert fake.stdout.readline().strip() == "ready"
        identity = WorkerIdentity(unique_tag("peer"), generation=1, model_name="m-peer")
        client = HiCacheClient(f"unix://{run / 'hicached.sock'}", timeout_s=5)
        with client, pytest.raises(HiCacheError) as info:
            client.attach(identity, pools.specs(), heartbeat=False)
        out, _ = fake.communicate(timeout=30)
    finally:
        pools.close()
        if fake.poll() is None:
            fake.kill()
            fake.wait()
    return info.value, int(out.split()[-1])


def test_buffers_are_not_handed_to_a_strangers_listener(squatted: Path) -> None:
    uid = other_user()
    err, received = _attach_to_stranger(squatted)
    assert err.code == grpc.StatusCode.PERMISSION_DENIED, err
    assert f"served by uid {uid}" in err.message and "HICACHED_DAEMON_UID" in err.message
    assert received == 0, "the stranger got the worker's memfds"


def test_hicached_daemon_uid_names_a_daemon_running_as_another_user(
    squatted: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the daemon runs as its own user (deploy/base: uid 10001), the workers name it."""
    uid = other_user()
    monkeypatch.setenv("HICACHED_DAEMON_UID", str(uid))
    _, received = _attach_to_stranger(squatted)
    assert received > 0, "the named uid is trusted with the buffers"
