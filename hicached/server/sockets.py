"""The daemon's Unix sockets belong to it: runtime directory, live-socket probe, inode-exact unlink.

Before binding, :func:`claim` checks the socket's directory (created by the
daemon with mode 0700, 0750 with an admin group; an existing one owned by
another user, or writable by its group or others, is refused: whoever can write
it can swap the socket) and the path to it (every directory and symlink on the
way owned by root or the daemon's uid: whoever owns one can re-point the path),
then probes the socket path: a live listener there is
another daemon (its pid comes from ``SO_PEERCRED`` of a probe connection, so
no pid file can go stale) and startup stops; a dead socket is replaced; any
other file is refused rather than deleted. The socket is bound under umask
0o177, so it never exists with looser permissions than 0600, and at stop it
is unlinked only when the path still names the file this daemon bound. Its mode
comes from the umask it is bound under (:func:`umask_for`), and its group is set
on a private name in that directory, without following symlinks, before it is
linked to the public one: nothing is chmodded by path (a chmod follows a symlink
put there). The directories above the socket directory are checked for their
owners, not their write bits (a pod's emptyDir is 0777 and root's): one others can
write lets them rename the socket directory away, so do not use one.

Not thread-safe (startup and shutdown run once, on one thread).
"""

from __future__ import annotations

import contextlib
import errno
import grp
import logging
import os
import socket
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hicached.errors import StartupError, clip
from hicached.paths import foreign_on_path

logger = logging.getLogger(__name__)

__all__ = [
    "BoundSocket",
    "claim",
    "group_id",
    "prepare_dir",
    "probe",
    "umask_for",
]


def group_id(name: str) -> int:
    """A group name or numeric gid -> gid; StartupError naming ``server.admin_group`` when unknown."""
    try:
        return int(name) if name.isdigit() else grp.getgrnam(name).gr_gid
    except KeyError:
        raise StartupError(f"server.admin_group = {name!r}: no such group") from None


def prepare_dir(directory: Path, *, gid: int | None) -> None:
    """Create ``directory`` (0700, or 0750 owned by group ``gid``) or check an existing one."""
    mode = 0o750 if gid is not None else 0o700
    _check_path(directory)
    created = True
    try:
        os.mkdir(directory, mode)
    except FileExistsError:
        created = False
    except FileNotFoundError:  # its parents too (they, unlike it, keep the umask's mode)
        directory.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(directory, mode)
    if created:
        # Through a descriptor of the directory just made, not its name (which a symlink
        # could replace in between): mkdir applied the umask.
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchmod(fd, mode)
            if gid is not None:
                os.fchown(fd, -1, gid)
        finally:
            os.close(fd)
        return
    # Again, now that the name exists: a symlink another user put there after the first
    # check (mkdir then found it) is refused, not followed.
    _check_path(directory)
    st = os.stat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise StartupError(f"socket directory {directory} exists and is not a directory")
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        raise StartupError(
            f"socket directory {directory} is owned by uid {st.st_uid}, not by this daemon's uid {me}: "
            "another user could swap the socket; remove it or choose another server.socket"
        )
    # Group-writable too: in a directory its group can write, a member can unlink the sockets
    # and bind its own (sticky or not: before the daemon binds, any name is free to take).
    for bit, who in ((stat.S_IWOTH, "others"), (stat.S_IWGRP, "its group")):
        if st.st_mode & bit:
            raise StartupError(
                f"socket directory {directory} is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}): "
                "they could swap the socket; use a directory only the daemon can write "
                "(workers need only search permission on it, o+x or g+x)"
            )


def _check_path(directory: Path) -> None:
    """StartupError unless every directory and symlink on the way to ``directory`` is root's or
    this daemon's (:func:`hicached.paths.foreign_on_path`): their owner could send the daemon's
    sockets, or its workers, elsewhere. The socket directory's own owner and mode are
    ``prepare_dir``'s to check."""
    me = os.geteuid()
    try:
        found = foreign_on_path(directory, (me, 0), itself=False)
    except OSError as exc:  # a loop, a file on the way, a directory this uid cannot search
        raise StartupError(f"socket directory {directory}: cannot check its path: {exc.strerror}") from None
    if found is not None:
        raise StartupError(
            f"socket directory {directory}: {found.path} on its path is {found.kind} owned by uid "
            f"{found.uid}, who could re-point it; use a path owned by root or uid {me}"
        )


def _peer_pid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, _, _ = struct.unpack("3i", creds)
    return int(pid)


def probe(path: Path) -> None:
    """Make ``path`` free for a new socket: refuse a live daemon's, replace a dead one's."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise StartupError(f"{path} exists and is not a socket; refusing to replace it")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(2.0)
        try:
            conn.connect(str(path))
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise StartupError(f"cannot probe the socket {path}: {exc.strerror}") from None
        else:
            raise StartupError(f"another hicached (pid {_peer_pid(conn)}) is serving on {path}")
    logger.info("replacing the dead socket %s", path, extra={"event": "socket", "path": str(path)})
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


# sun_path holds 108 bytes with its NUL. The daemon binds each socket at a private
# ``.hc-<pid>-<role>`` beside it before publishing it, and the worker socket's side sockets
# (``<socket>.lane``, ``<socket>.fds``) are reached by their full names.
MAX_SOCKET_PATH = 107
SIDE_SUFFIX = len(".lane")  # the longer of the worker socket's side sockets' suffixes


def claim(path: Path, *, gid: int | None, key: str = "server.socket", side: int = 0) -> None:
    """:func:`prepare_dir` of the socket's directory, then :func:`probe` of the socket. A path
    no Unix socket can be bound at (too long with ``side`` more bytes, a directory that
    cannot be made) is a StartupError naming ``key``, the setting that chose the path."""
    longest = max(len(os.fsencode(path)) + side, len(os.fsencode(BoundSocket.private_path(path, "w"))))
    if longest > MAX_SOCKET_PATH:
        raise StartupError(
            f"socket path {clip(str(path), 48)} is too long for a Unix socket ({len(os.fsencode(path))} "
            f"bytes; with its side sockets it needs {longest}, at most {MAX_SOCKET_PATH}): choose a "
            f"shorter {key}"
        )
    try:
        prepare_dir(path.parent, gid=gid)
    except OSError as exc:
        raise StartupError(
            f"cannot create the socket directory {path.parent}: {exc.strerror}; choose another {key}"
        ) from None
    probe(path)


@contextlib.contextmanager
def umask_for(mode: int) -> Iterator[None]:
    """Sockets bound inside are created with ``mode`` (a socket's bits are 0777 less the umask;
    process-wide umask, startup only): no chmod afterwards, which would follow a symlink."""
    old = os.umask(0o777 & ~mode)
    try:
        yield
    finally:
        os.umask(old)


@dataclass(frozen=True)
class BoundSocket:
    """A socket file this daemon bound: its path and identity (device, inode, ctime).

    The ctime is part of the identity because a freed inode number is reused at
    once (a socket another process binds after ours was unlinked often gets it).
    """

    path: Path
    dev: int
    ino: int
    ctime_ns: int

    @staticmethod
    def private_path(path: Path, role: str) -> Path:
        """Where gRPC binds the socket before :meth:`publish` links it to ``path``.

        gRPC unlinks the path it bound at stop, whatever file is there by then;
        binding a private name and serving under a hard link to it keeps the
        public name in the daemon's hands (:meth:`unlink`)."""
        return path.parent / f".hc-{os.getpid()}-{role}"

    @classmethod
    def publish(cls, private: Path, path: Path, gid: int | None = None) -> BoundSocket:
        """Give the socket bound at ``private`` (under :func:`umask_for` its mode) its group, link
        it to ``path`` (which must not exist: a daemon that raced us there wins) and drop the
        private name. Neither step follows a symlink: one swapped in at either name would
        otherwise have them act on its target."""
        try:
            if gid is not None:
                try:
                    os.chown(private, -1, gid, follow_symlinks=False)
                except PermissionError:
                    raise StartupError(
                        f"server.admin_group: cannot give {path} to gid {gid} (the daemon is not a member)"
                    ) from None
            os.link(private, path, follow_symlinks=False)
        except FileExistsError:
            raise StartupError(f"another hicached took {path} while this one started") from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(private)
        st = os.lstat(path)
        return cls(path, st.st_dev, st.st_ino, st.st_ctime_ns)

    @classmethod
    def bind(cls, listener: socket.socket, path: Path, mode: int, role: str) -> BoundSocket:
        """Bind ``listener`` (AF_UNIX) at ``path`` with ``mode``: :func:`probe` of the path (a live
        daemon's is refused, a dead one's replaced, any other file kept), then bound at a private
        name under :func:`umask_for` ``mode`` and :meth:`publish` ed: the public name never has
        other permissions and nothing is chmodded."""
        probe(path)
        private = cls.private_path(path, role)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(private)  # a name of a dead daemon with our pid
        with umask_for(mode):
            listener.bind(str(private))
        return cls.publish(private, path)

    def unlink(self) -> bool:
        """Unlink the path if it is still our inode (another daemon may have replaced it); True
        when it was removed. Never raises: it runs at shutdown, where one socket left behind
        must not keep the others (or the rest of the shutdown) from going. A failure to look or
        to remove (the directory made read-only, say) is logged as a warning naming the path
        and the error, and returns False; a path already gone returns False quietly."""
        try:
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino, st.st_ctime_ns) != (self.dev, self.ino, self.ctime_ns):
                logger.warning(
                    "not removing %s: it is no longer this daemon's socket",
                    self.path,
                    extra={"event": "socket", "path": str(self.path)},
                )
                return False
            os.unlink(self.path)
        except FileNotFoundError:
            return False
        except OSError as exc:
            logger.warning(
                "cannot remove the socket %s: %s; remove it by hand (a daemon starting there replaces it)",
                self.path,
                exc,
                extra={"event": "socket", "path": str(self.path)},
            )
            return False
        return True
