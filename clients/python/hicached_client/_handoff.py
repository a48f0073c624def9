"""The client half of the fd handoff and of the session capability.

Shared by the sync and the asyncio client. Buffers are never named: a worker
exports them as :class:`~hicached_client.v1.types_pb2.FdHandle` whose ``fd_index``
holds the worker's LOCAL fd number (see :func:`hicached_client.export.export_fd_tensor`);
:func:`prepare` collects those fds in order, renumbers ``fd_index`` to their position
(the wire meaning) and :func:`hand_over` sends them to ``<socket>.fds`` with
SCM_RIGHTS, which answers with a one-use ticket for the AttachRequest.

Before anything is sent, :func:`prepare` checks each fd (:func:`check_owned`): it must be
open and, when this library created or exported it (:func:`record_export`: ``sealed_memfd``,
``export_fd_tensor``, ``CudaFdAllocation.export``), still be that memory (the ``(st_dev,
st_ino)`` recorded then), and not be a number a pool closed (:func:`forget_export`) that the
library has not handed out again since. Otherwise a stale spec would hand over whatever now
has the number (the handoff's own socket, a file) and the daemon would copy the wrong memory.
A number handed out again (a newer pool's memfd) cannot be told from it: the spec carries
only the number.

Thread-safety: the export table is guarded by a lock; :func:`hand_over` blocks for one round trip.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
from collections.abc import Sequence

import grpc

from hicached_client import pathwalk
from hicached_client.errors import HiCacheError
from hicached_client.v1 import types_pb2 as tpb

log = logging.getLogger(__name__)

MAGIC = b"hicached-fds-v1"
SUFFIX = ".fds"
DAEMON_UID_ENV = "HICACHED_DAEMON_UID"
# Metadata key carrying AttachResponse.session_secret on every call of a session.
SESSION_SECRET_METADATA = "x-hicached-session-secret"
_MAX_REPLY = 512

# Local fd number -> (st_dev, st_ino) of what it was exported as; None once its pool closed it.
_exported: dict[int, tuple[int, int] | None] = {}
_exported_lock = threading.Lock()


def record_export(fd: int) -> None:
    """Remember what ``fd`` refers to now: memory this library created or is exporting."""
    st = os.fstat(fd)
    with _exported_lock:
        _exported[fd] = (st.st_dev, st.st_ino)


def forget_export(fd: int) -> None:
    """``fd`` is about to be closed by its pool: specs still naming it are refused."""
    with _exported_lock:
        _exported[fd] = None


def handoff_path(target: str) -> str | None:
    """The handoff socket next to a ``unix:`` target's socket; None for TCP targets."""
    if not target.startswith("unix:"):
        return None
    path = target[len("unix:") :]
    if path.startswith("//"):
        path = path[2:]
    return path + SUFFIX


def prepare(pools: Sequence[tpb.PoolSpec]) -> tuple[list[tpb.PoolSpec], list[int]]:
    """Copies of ``pools`` whose FdHandles index the returned fd list (the caller's pools are untouched)."""
    fds: list[int] = []
    position: dict[int, int] = {}
    out: list[tpb.PoolSpec] = []
    for pool in pools:
        copy = tpb.PoolSpec()
        copy.CopyFrom(pool)
        for buf in (*copy.k_buffers, *copy.v_buffers):
            kind = buf.handle.WhichOneof("kind")
            if kind not in ("fd", "cuda_fd"):
                continue
            handle = buf.handle.fd if kind == "fd" else buf.handle.cuda_fd
            local = handle.fd_index
            if local not in position:
                position[local] = len(fds)
                fds.append(local)
            handle.fd_index = position[local]
        out.append(copy)
    check_owned(fds)  # before the handoff socket exists: it could take a closed fd's number
    return out, fds


def trusted_uids() -> frozenset[int]:
    """Who may receive this process's buffers: root, this process's uid, and
    ``$HICACHED_DAEMON_UID`` when set (a daemon running as its own user, as in deploy/base)."""
    uids = {0, os.geteuid()}
    env = os.environ.get(DAEMON_UID_ENV, "").strip()
    if env:
        if not (env.isascii() and env.isdigit()):
            raise HiCacheError(
                grpc.StatusCode.INVALID_ARGUMENT, f"{DAEMON_UID_ENV}={env[:32]!r} is not a numeric uid"
            )
        uids.add(int(env))
    return frozenset(uids)


def check_daemon(
    sock: socket.socket, path: str, *, what: str = "fd handoff", refusing: str = "hand buffers over"
) -> None:
    """PERMISSION_DENIED unless the process listening at ``path`` runs as a :func:`trusted_uids`
    uid (``SO_PEERCRED``: the kernel's word, not the peer's). Whoever can put a socket at the
    path (a squatted ``/tmp/hicached-<uid>``, a directory its group can write) would otherwise
    receive the worker's memory, read it and write into it (the fd handoff), or its session's
    secret and its ops (the fast lane)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    if uid not in trusted_uids():
        raise HiCacheError(
            grpc.StatusCode.PERMISSION_DENIED,
            f"the {what} socket {path} is served by uid {uid} (pid {pid}), not by root or this "
            f"process's uid {os.geteuid()}: refusing to {refusing} (if uid {uid} runs your "
            f"daemon, set {DAEMON_UID_ENV}={uid})",
        )


def check_socket_dir(target: str) -> None:
    """PERMISSION_DENIED unless only :func:`trusted_uids` can put a socket at a ``unix:`` target's
    path: every directory the way to the socket passes through and every symlink it follows
    (the kernel's way, :func:`hicached_client.pathwalk.walk`: ``link/..`` and symlinks met
    half-way included, the socket's own name when it is a symlink) owned by one of them, and the
    directory that holds the socket not writable by its group or others (the daemon's own rule
    for it). Whoever could put a socket there would receive the worker's token and Attach and
    answer its calls (the gRPC channel cannot ask the kernel who listens, as
    :func:`check_daemon` does). A pass is kept for the client's life: every reconnect of the
    channel stays in trusted hands while no directory above the socket's is writable by others
    without the sticky bit (whoever can write one can rename the socket's directory away; the
    daemon accepts such a layout, a pod's emptyDir holding the daemon's ``sock/``, where the
    others are the pod's own containers). Returns for TCP targets.
    UNAVAILABLE, naming the directory, when it does not exist (nothing to judge: the call must
    not go ahead, or whoever creates it first gets the connection) or cannot be walked (a
    parent that is a file, a symlink loop); PERMISSION_DENIED when this user may not search
    one of its directories (another user's daemon). The check judges the path, not a
    connection the channel already holds: every entry point that may connect (calls,
    :meth:`wait_ready`) runs it first. Thread-safe (reads the file system only)."""
    path = handoff_path(target)
    if path is None:
        return
    sock = path[: -len(SUFFIX)]  # as written: abspath would undo a `link/..` as text
    try:
        way = pathwalk.walk(sock)
    except PermissionError as exc:  # not this user's to enter: the daemon's user, or its group
        raise HiCacheError(
            grpc.StatusCode.PERMISSION_DENIED,
            f"this user may not enter the daemon's socket directory {os.path.dirname(sock)} "
            f"({exc.strerror}): a daemon of another user admits its group (server.socket_mode, "
            f"server.admin_group); or start your own (`hicached serve`) and point $HICACHED_SOCKET at it",
        ) from None
    except OSError as exc:
        raise HiCacheError(
            grpc.StatusCode.UNAVAILABLE,
            f"cannot check the daemon's socket directory {os.path.dirname(sock)}: {exc.strerror}",
        ) from None
    if len(way.remaining) > 1:
        raise HiCacheError(
            grpc.StatusCode.UNAVAILABLE,
            f"the daemon's socket directory {way.missing} does not exist (is the daemon running?); "
            "not connecting until it does",
        )
    _judge_socket_dir(sock, way, trusted_uids())


def _judge_socket_dir(sock: str, way: pathwalk.Walk, trusted: frozenset[int]) -> None:
    # The directory holding the socket (or where the socket would be): the last one reached.
    holder = way.reached if way.remaining else os.path.dirname(way.reached)
    for step in way.steps:
        if step is way.final:
            continue  # the socket itself: whoever listens there is the daemon's directory's choice
        if step.st.st_uid not in trusted:
            raise HiCacheError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{step.path}, on the way to the daemon's socket {sock}, is owned by uid {step.st.st_uid}, "
                f"not by root or this process's uid {os.geteuid()}: refusing to connect (if uid "
                f"{step.st.st_uid} runs your daemon, set {DAEMON_UID_ENV}={step.st.st_uid})",
            )
        if step.path == holder and step.directory and step.st.st_mode & 0o022:
            # A mistyped path in /tmp lands here too: say that nothing is there either.
            missing = f" (and there is no socket {sock}: check the path)" if way.remaining else ""
            raise HiCacheError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"the daemon's socket directory {holder} is writable by its group or others "
                f"(mode {step.st.st_mode & 0o777:o}): anyone who can write it can answer as the "
                f"daemon; refusing to connect{missing}",
            )


def hand_over(path: str, fds: Sequence[int], timeout_s: float | None) -> str | None:
    """Send ``fds`` (may be empty) to the daemon's handoff socket; returns the ticket.

    Without fds, a daemon that has no handoff socket is not an error (None: attach
    without a ticket). The fds stay open here: the daemon received duplicates.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            if not fds:
                log.debug("no fd handoff socket at %s (%s); attaching without a ticket", path, exc)
                return None
            raise HiCacheError(
                grpc.StatusCode.UNAVAILABLE,
                f"cannot hand buffers over: no daemon handoff socket at {path} ({exc})",
            ) from None
        if fds:
            check_daemon(sock, path)
        socket.send_fds(sock, [MAGIC], list(fds))
        reply = b""
        while not reply.endswith(b"\n") and len(reply) < _MAX_REPLY:
            chunk = sock.recv(_MAX_REPLY)
            if not chunk:
                break
            reply += chunk
    except TimeoutError:
        raise HiCacheError(grpc.StatusCode.DEADLINE_EXCEEDED, f"fd handoff to {path} timed out") from None
    except OSError as exc:
        raise HiCacheError(grpc.StatusCode.UNAVAILABLE, f"fd handoff to {path} failed: {exc}") from None
    finally:
        sock.close()
    text = reply.decode("utf-8", "replace").strip()
    if text.startswith("ok "):
        return text[3:]
    code = grpc.StatusCode.UNAVAILABLE  # no answer at all: the daemon went away mid-handoff
    reason = text or "connection closed without an answer"
    if text.startswith("error "):
        name, _, reason = text[len("error ") :].partition(" ")
        got = getattr(grpc.StatusCode, name, None) if name.isupper() else None
        code = got if isinstance(got, grpc.StatusCode) else grpc.StatusCode.UNKNOWN
    raise HiCacheError(code, f"the daemon refused the fd handoff: {reason}")


def check_owned(fds: Sequence[int]) -> None:
    """ValueError naming the first fd that is not open in this process, belonged to a closed
    pool, or no longer refers to the memory it was exported as."""
    for fd in fds:
        try:
            st = os.fstat(fd)
        except OSError:
            raise ValueError(f"exported fd {fd} is not open (was its pool closed?)") from None
        with _exported_lock:
            known = fd in _exported
            identity = _exported.get(fd)
        if known and identity is None:
            raise ValueError(f"exported fd {fd} belonged to a pool that was closed; export the buffers again")
        if identity is not None and identity != (st.st_dev, st.st_ino):
            raise ValueError(f"exported fd {fd} is no longer the memory it was exported from")
