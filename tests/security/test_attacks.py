"""Issue 9 attacks 1-4 against a real daemon subprocess: each is refused with a precise status
(or impossible by construction, which the test demonstrates) and GetStats is unchanged.

On the code before the fd handoff, the named-segment attacks mapped the target
(the symlinked file was read and overwritten; the daemon's own host pool was
mapped), truncating an exported segment killed the daemon with SIGBUS, and a
session id alone was enough to act as that session.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from hicached_client import HiCacheClient, HiCacheError, Session, Transfer, WorkerIdentity, _calls, pool_spec
from hicached_client._convert import identity_to_wire
from hicached_client._handoff import hand_over, handoff_path, prepare
from hicached_client.export import export_fd_tensor, sealed_memfd
from hicached_client.v1 import hicached_pb2 as pb
from hicached_client.v1 import hicached_pb2_grpc as pb_grpc
from hicached_client.v1 import types_pb2 as tpb

from tests.support.daemon import Daemon, start_daemon
from tests.support.kv import KV_DIM, KV_HEADS, PAGE_SIZE, WorkerPools, transfers, unique_tag
from tests.support.state import state

from .users import other_user, run_as_other

C = grpc.StatusCode
SECRET = b"root-only secret: must never leave this file\n" * 8


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    # 0666 so that the second uid can reach the sockets at all (access control by the
    # socket mode is the deployment's choice; these tests attack what lies behind it).
    d = start_daemon("--set", "server.socket_mode=0o666")
    try:
        yield d
    finally:
        d.stop()


@dataclass
class Worker:
    client: HiCacheClient
    pools: WorkerPools
    session: Session
    identity: WorkerIdentity


@pytest.fixture
def victim(daemon: Daemon) -> Iterator[Worker]:
    client = HiCacheClient(daemon.target, timeout_s=30.0)
    pools = WorkerPools.create(unique_tag("victim"))
    pools.fill_random(3)
    ident = WorkerIdentity(unique_tag("victim"), generation=1, model_name="m-sec")
    session = client.attach(ident, pools.specs(), heartbeat=False)
    try:
        yield Worker(client, pools, session, ident)
    finally:
        try:
            session.close()
        finally:
            client.close()
            pools.close()


def identity(tag: str = "attacker", model: str = "m-sec") -> WorkerIdentity:
    return WorkerIdentity(unique_tag(tag), generation=1, model_name=model)


def spec_with(buffers: list[tpb.DeviceBuffer]) -> list[tpb.PoolSpec]:
    return [
        pool_spec(
            "kv",
            role="anchor",
            kind="mha",
            dtype="float16",
            host_layout="layer_first",
            page_size=PAGE_SIZE,
            num_layers=1,
            num_heads=KV_HEADS,
            head_dim=KV_DIM,
            k_buffers=buffers[:1],
            v_buffers=buffers[1:2],
            host_ratio=1.0,
        )
    ]


def named(name: str, size: int) -> tpb.DeviceBuffer:
    """A buffer named by /dev/shm segment, as clients sent them before the fd handoff."""
    tokens = size // (KV_HEADS * KV_DIM * 2)
    return tpb.DeviceBuffer(
        handle=tpb.DeviceHandle(shm=tpb.ShmHandle(name=name, offset=0, size=size)),
        shape=[tokens, KV_HEADS, KV_DIM],
        dtype=tpb.DATA_TYPE_FLOAT16,
    )


def attack_attach(
    client: HiCacheClient, buffers: list[tpb.DeviceBuffer], model: str = "m-sec"
) -> HiCacheError:
    with pytest.raises(HiCacheError) as info:
        client.attach(identity(model=model), spec_with(buffers), heartbeat=False)
    return info.value


# ------------------------------------------------------------ attack 1: files by name


def test_a_symlink_in_dev_shm_to_a_root_only_file_is_never_opened(daemon: Daemon) -> None:
    target = Path(daemon.workdir) / f"secret-{uuid.uuid4().hex[:8]}"
    target.write_bytes(SECRET)
    os.chmod(target, 0o600)
    link = Path("/dev/shm") / f"hcsec-{uuid.uuid4().hex[:8]}"
    link.symlink_to(target)
    try:
        with HiCacheClient(daemon.target) as client:
            before = state(client)
            for model in ("m-sec", f"m-new-{uuid.uuid4().hex[:6]}"):  # existing group and a new one
                err = attack_attach(client, [named(link.name, 4096), named(link.name, 4096)], model)
                assert err.code == C.INVALID_ARGUMENT, err
                assert (
                    "handle.shm" in err.message
                    and "refused" in err.message
                    and "file descriptors" in err.message
                )
            assert state(client) == before
        assert target.read_bytes() == SECRET
    finally:
        link.unlink()


def test_a_foreign_segment_name_is_refused_over_a_raw_stub(daemon: Daemon) -> None:
    """No client library in the way: the wire message itself is refused."""
    name = f"hcsec-{uuid.uuid4().hex[:8]}"
    (Path("/dev/shm") / name).write_bytes(bytes(8192))
    try:
        with grpc.insecure_channel(daemon.target) as channel:
            stub = pb_grpc.HiCacheServiceStub(channel)  # type: ignore[no-untyped-call]
            req = pb.AttachRequest(
                identity=identity_to_wire(identity()), pools=spec_with([named(name, 4096)] * 2)
            )
            with pytest.raises(grpc.RpcError) as info:
                stub.Attach(req, timeout=30)
        assert info.value.code() == C.INVALID_ARGUMENT
        assert "is refused" in (info.value.details() or "")
    finally:
        (Path("/dev/shm") / name).unlink()


# ------------------------------------------------ attack 2: the daemon's own segments


def test_the_daemons_own_host_pool_segments_cannot_be_mapped(daemon: Daemon, victim: Worker) -> None:
    # A worker's GetStats no longer shows segment names; the admin's does, and even knowing them
    # the attacker gets nothing.
    with HiCacheClient(daemon.admin_target) as admin:
        stats = admin.get_stats()
    segments = [p.segment for g in stats.groups for p in g.pools if p.segment]
    assert segments, "the victim's group has host-pool segments"
    with HiCacheClient(daemon.target) as client:
        before = state(client)
        for seg in segments:
            err = attack_attach(client, [named(seg, 4096), named(seg, 4096)])
            assert err.code == C.INVALID_ARGUMENT and "refused" in err.message, err
        assert state(client) == before


# ----------------------------------------------------------- attack 3: kill the daemon


def _attacker_fd_buffers(fd: int, size: int) -> list[tpb.DeviceBuffer]:
    half = size // 2
    tokens = half // (KV_HEADS * KV_DIM * 2)
    t = torch.zeros(tokens, KV_HEADS, KV_DIM, dtype=torch.float16)
    return [export_fd_tensor(fd, 0, t), export_fd_tensor(fd, half, t)]


def test_a_buffer_that_can_still_shrink_is_refused(daemon: Daemon) -> None:
    size = 2 * 64 * KV_HEADS * KV_DIM * 2
    unsealed = os.memfd_create("hcsec-unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, size)
    shm_path = Path("/dev/shm") / f"hcsec-{uuid.uuid4().hex[:8]}"
    shm_fd = os.open(shm_path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(shm_fd, size)
    try:
        with HiCacheClient(daemon.target) as client:
            before = state(client)
            for fd in (unsealed, shm_fd):
                err = attack_attach(client, _attacker_fd_buffers(fd, size))
                assert err.code == C.INVALID_ARGUMENT, err
                assert "seal it with F_SEAL_SHRINK" in err.message
            assert state(client) == before
    finally:
        os.close(unsealed)
        os.close(shm_fd)
        shm_path.unlink()


HUGE_PAGE = 2 << 20


def test_a_sealed_hugetlb_memfd_is_refused(daemon: Daemon) -> None:
    """A reviewer's repro killed the daemon with SIGBUS: a sealed ``MFD_HUGETLB`` memfd passed
    every check; its sender punched a hole (the seal does not stop it, and it frees the huge
    pages and their reservation), took the pages with another file and asked for a Load. Now
    only tmpfs memfds are mapped. (No huge pages are needed here: the refusal comes before any
    mapping; before, this attach got a misleading RESOURCE_EXHAUSTED from the failing mmap.)"""
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | os.MFD_HUGETLB
    fd = os.memfd_create("hcsec-hugetlb", flags)
    try:
        os.ftruncate(fd, 2 * HUGE_PAGE)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        with HiCacheClient(daemon.target) as client:
            before = state(client)
            err = attack_attach(client, _attacker_fd_buffers(fd, 2 * HUGE_PAGE))
            assert err.code == C.INVALID_ARGUMENT, err
            assert "not on tmpfs" in err.message and "MFD_HUGETLB" in err.message, err.message
            assert state(client) == before
    finally:
        os.close(fd)


def _cuda_fd_buffers(fd: int, size: int, allocation_size: int) -> list[tpb.DeviceBuffer]:
    half = size // 2
    tokens = half // (KV_HEADS * KV_DIM * 2)
    return [
        tpb.DeviceBuffer(
            handle=tpb.DeviceHandle(
                cuda_fd=tpb.CudaFdHandle(
                    fd_index=fd, allocation_size=allocation_size, offset=i * half, size=half
                )
            ),
            shape=[tokens, KV_HEADS, KV_DIM],
            dtype=tpb.DATA_TYPE_FLOAT16,
        )
        for i in range(2)
    ]


def test_a_cuda_fd_handle_is_checked_before_import_and_refused(daemon: Daemon) -> None:
    """The POSIX-fd CUDA handle travels the handoff like a memfd. Whatever fd it carries (here a
    sealed memfd, as an attacker could send), the daemon refuses it with a status -- a range
    beyond the claimed allocation before anything is opened; then, on a CPU machine, no CUDA
    device, and on a GPU machine the driver's refusal to import it, named as the client's
    error -- and nothing changes."""
    size = 2 * 64 * KV_HEADS * KV_DIM * 2
    fd = sealed_memfd("hcsec-cudafd", size)
    try:
        with HiCacheClient(daemon.target) as client:
            before = state(client)
            err = attack_attach(client, _cuda_fd_buffers(fd, size, allocation_size=size // 4))
            assert err.code == C.INVALID_ARGUMENT and "beyond the allocation" in err.message, err
            err = attack_attach(client, _cuda_fd_buffers(fd, size, allocation_size=size))
            if torch.cuda.is_available():  # the daemon runs on this machine
                assert err.code == C.INVALID_ARGUMENT, err
                assert "the fd is not a CUDA allocation" in err.message, err
            else:
                assert err.code == C.FAILED_PRECONDITION and "no CUDA device" in err.message, err
            assert state(client) == before
    finally:
        os.close(fd)


FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def test_truncating_or_punching_an_exported_buffer_during_copies_cannot_crash_the_daemon(
    daemon: Daemon, victim: Worker
) -> None:
    """Truncation is impossible by construction (the memfd is sealed: EPERM); punching holes,
    the one size-preserving change left, only zeroes the worker's own pages."""
    libc = ctypes.CDLL(None, use_errno=True)
    pools, session = victim.pools, victim.session
    stop = threading.Event()
    refused: list[int] = []

    def vandal() -> None:
        while not stop.is_set():
            for pool in (pools.kv, pools.draft):
                try:
                    os.ftruncate(pool.fd, 0)
                except PermissionError:
                    refused.append(pool.fd)
                rc = libc.fallocate(
                    pool.fd,
                    FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                    ctypes.c_long(0),
                    ctypes.c_long(pool.size),
                )
                assert rc == 0, os.strerror(ctypes.get_errno())

    thread = threading.Thread(target=vandal)
    thread.start()
    try:
        for i in range(20):
            w = session.write(transfers([i, i + 1]), allocate=True)
            assert w.ok
            session.load_wait([Transfer(t.pool, [100 + i, 101 + i], t.host_pages) for t in w.transfers])
            session.release_transfers(w.transfers)
    finally:
        stop.set()
        thread.join()
    assert refused, "ftruncate of the sealed memfd was never attempted"
    assert daemon.process.poll() is None, daemon.log
    assert os.fstat(pools.kv.fd).st_size == pools.kv.size
    with HiCacheClient(daemon.target) as client:
        assert client.ping(b"alive") == b"alive"


# ------------------------------------------------ attack 4: act as another session


def _without_secret(client: HiCacheClient, victim: Worker, secret: str) -> list[tuple[str, HiCacheError]]:
    forged = client.session(victim.session.session_id, session_secret=secret)
    calls = {
        "Heartbeat": forged.heartbeat,
        "Alloc": lambda: forged.alloc("kv", 1),
        "Write": lambda: forged.write(transfers([0, 1]), allocate=True),
        "Load": lambda: forged.load_wait(transfers([0], {"kv": [0], "draft": [0]})),
        "RetractDiscard": lambda: forged.retract_discard("b" * 32),
        "GetStats(session)": forged.stats,
        "Detach": forged.detach,
    }
    errors = []
    for name, call in calls.items():
        with pytest.raises(HiCacheError) as info:
            call()
        errors.append((name, info.value))
    return errors


@pytest.mark.parametrize("secret", ["", "0" * 32, "x"], ids=["missing", "wrong", "short"])
def test_another_sessions_id_without_its_secret_is_permission_denied(
    daemon: Daemon, victim: Worker, secret: str
) -> None:
    with HiCacheClient(daemon.target) as client:
        before = state(client)
        for name, err in _without_secret(client, victim, secret):
            assert err.code == C.PERMISSION_DENIED, (name, err)
            assert "x-hicached-session-secret" in err.message, (name, err)
        assert state(client) == before
    # The owner, with the secret, still has its session.
    assert victim.session.heartbeat() > 0
    assert victim.session.info.session_secret not in repr(victim.session.info)


def test_the_session_secret_is_128_random_bits_per_session(daemon: Daemon, victim: Worker) -> None:
    secret = victim.session.info.session_secret
    assert len(secret) == 32 and int(secret, 16) >= 0
    with HiCacheClient(daemon.target) as client:
        pools = WorkerPools.create(unique_tag("second"))
        try:
            other = client.attach(identity("second"), pools.specs(), heartbeat=False)
            assert other.info.session_secret != secret and len(other.info.session_secret) == 32
            # One session's secret does not open another.
            with pytest.raises(HiCacheError) as info:
                client.session(
                    victim.session.session_id, session_secret=other.info.session_secret
                ).heartbeat()
            assert info.value.code == C.PERMISSION_DENIED
            other.detach()
        finally:
            pools.close()


# ------------------------------------------------------------- tickets and uids


def test_a_used_or_forged_ticket_is_refused_also_for_another_uid(daemon: Daemon) -> None:
    """The second uid's attempts run as another user (CI runs as root; skips only when not root)."""
    other_user()
    path = handoff_path(daemon.target)
    assert path is not None
    pools = WorkerPools.create(unique_tag("owner"))
    try:
        with HiCacheClient(daemon.target) as client:
            wire, fds = prepare(pools.specs())
            ticket = hand_over(path, fds, timeout_s=10)
            assert ticket
            session = client.invoke(_calls.attach("", identity("owner"), wire, 0, ticket))  # consumes it
            before = state(client)
            code = (
                "import sys, grpc\n"
                "from hicached_client import HiCacheClient, HiCacheError, WorkerIdentity\n"
                "from hicached_client import _calls\n"
                "target, ticket = sys.argv[1], sys.argv[2]\n"
                "with HiCacheClient(target) as c:\n"
                "    for t in (ticket, '0' * 32):\n"
                "        try:\n"
                "            c.invoke(_calls.attach('', WorkerIdentity('thief', 1, 'm-sec'), [], 0, t))\n"
                "            print('ATTACHED')\n"
                "        except HiCacheError as e:\n"
                "            print(e.code.name, e.message)\n"
            )
            proc = run_as_other(code, daemon.target, ticket)
            assert proc.returncode == 0, proc.stderr[-2000:]
            lines = proc.stdout.strip().splitlines()
            assert len(lines) == 2
            for line in lines:
                assert line.startswith("PERMISSION_DENIED") and "unknown, expired or already used" in line
            assert state(client) == before
            client.session(session.session_id, session_secret=session.session_secret).detach()
    finally:
        pools.close()


REPLACE = """
import sys
from hicached_client import HiCacheClient, HiCacheError, WorkerIdentity, pool_spec
target, instance = sys.argv[1], sys.argv[2]
spec = pool_spec("kv", role="anchor", kind="mha", dtype="float16", page_size=4, num_layers=1,
                 num_heads=2, head_dim=16, k_buffers=[], host_bytes=1 << 20)
with HiCacheClient(target) as c:
    try:
        c.attach(WorkerIdentity(instance, 2, "m-sec"), [spec], heartbeat=False)
        print("REPLACED")
    except HiCacheError as e:
        print(e.code.name, e.message)
"""


def test_another_uid_cannot_replace_a_workers_session_by_generation(daemon: Daemon, victim: Worker) -> None:
    """Before: any client attaching the victim's instance id with a higher generation ended the
    victim's session. The slot now belongs to the uid the kernel reported at its handoff.

    The refusal does not name that uid: it said "is attached by uid 0; only that uid may
    replace it", so any peer could learn who runs a given instance id."""
    other_user()
    with HiCacheClient(daemon.target) as client:
        before = state(client)
        proc = run_as_other(REPLACE, daemon.target, victim.identity.instance_id)
        assert proc.returncode == 0, proc.stderr[-2000:]
        out = proc.stdout.strip()
        assert out.startswith("PERMISSION_DENIED") and "is attached by another peer" in out, out
        assert "unique" in out, out  # says what to do: an instance_id unique in the deployment
        assert f"uid {os.geteuid()}" not in out and "only that uid" not in out, out
        assert state(client) == before
    assert victim.session.heartbeat() > 0
