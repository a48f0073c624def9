"""Warm-restart journals: what a cleanly stopped daemon leaves for the next one.

With ``host.warm_restart`` on, a pool group's host pools live in segments
named ``{shm_prefix}-{group_id}-{pool}`` that outlive the daemon. On a clean
shutdown the daemon writes one journal per group,
``{journal_dir}/{shm_prefix}-{group_id}.json``: a format version, the pools
(name, usable pages, segment) and the content index's entries, least
recently used first. The next daemon re-maps the segments when a worker
recreates the group, replays the entries and deletes the journal at once: a
journal is consumed exactly once, so a later crash never replays stale state.

A crash writes no journal; segments found without one are unlinked (their
pages may have been half written). Only one daemon may use a prefix's
journals at a time; :meth:`JournalStore.lock` enforces that with an
advisory lock the kernel drops when the holder dies, in the journal directory and in
``/dev/shm`` (:mod:`hicached.l2.prefix_lock`: one prefix, two journal directories).

Journals list tenants and their keys, and the next daemon maps what they name: a journal is
created 0600 and the directory 0700, as the lock file and the file L3's slabs are; a
``journal_dir`` another user owns, or one on a path through another user's directory or symlink
is refused (FailedPrecondition), and journals are read only as regular files of the daemon's
uid. What bounds the journals a prefix keeps is :mod:`hicached.core.warm`; what bounds one
journal's bytes is :meth:`JournalStore.bound`: what a group of its pools' pages can hold (one
entry per page at most, each key and tenant at their longest, escaped). A larger journal is
refused unread (its group starts cold) and never written (its group is dropped).

Thread-safety: the methods are independent file operations; the caller
serialises work on one group (the group registry's lock does), and calls
:meth:`JournalStore.write` from one thread at a time (the registry's close writes
one journal after another), as it keeps the last write's time.
Atomicity: :meth:`JournalStore.write` replaces a journal atomically (tmp
file, fsync, rename, fsync of the directory); readers never see half of one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hicached_client.pathwalk import Walk, walk

from hicached.errors import FailedPrecondition
from hicached.index.entries import EntryRecord
from hicached.l2.prefix_lock import ShmPrefixLock
from hicached.paths import foreign_in

logger = logging.getLogger(__name__)

__all__ = ["JOURNAL_FORMAT", "JOURNAL_VERSION", "TENANT_BYTES", "GroupJournal", "JournalStore", "PoolRecord"]

JOURNAL_FORMAT = "hicached-l2-journal"
JOURNAL_VERSION = 2  # 2: each pool names its segment's incarnation

# The longest tenant name (hicached.server.rpc_sessions.MAX_TENANT_BYTES; core does not import
# the server, a test checks they agree).
TENANT_BYTES = 256
# What an index key adds to a client's: "~" and the tenant's 32-hex tag (hicached.core.keyed).
_KEY_SCOPE_BYTES = 33
# json.dump escapes a control character as \uXXXX: 6 bytes for one byte of UTF-8, the most
# any character takes (a 4-byte one is a surrogate pair, 12).
_ESCAPE = 6
# The format, version, group id and brackets; then per pool its record (name and segment,
# each within a segment name's 200 bytes, escaped) and its name again as a page column's.
_HEADER_BYTES = 1024
_POOL_BYTES = 4096
# Per entry besides its key, tenant and page numbers: quotes, commas and "false".
_ENTRY_BYTES = 16


@dataclass(frozen=True)
class PoolRecord:
    """One host pool of a journaled group (immutable)."""

    name: str
    num_pages: int
    segment: str
    incarnation: str  # the segment's (:attr:`hicached.l2.host_pool.HostKVPool.incarnation`)


@dataclass(frozen=True)
class GroupJournal:
    """A group's pools and its content index entries (least recently used first)."""

    group_id: str
    pools: tuple[PoolRecord, ...]
    entries: tuple[EntryRecord, ...]

    def to_json(self) -> dict[str, Any]:
        # Columns rather than one object per entry: a big index journals in a fraction of the bytes.
        alloc = sorted(self.entries[0].pages) if self.entries else []
        return {
            "format": JOURNAL_FORMAT,
            "version": JOURNAL_VERSION,
            "group_id": self.group_id,
            "pools": [
                {"name": p.name, "num_pages": p.num_pages, "segment": p.segment, "incarnation": p.incarnation}
                for p in self.pools
            ],
            "entries": {
                "keys": [e.key for e in self.entries],
                "tenants": [e.tenant for e in self.entries],
                "in_l3": [e.in_l3 for e in self.entries],
                "pages": {name: [e.pages[name] for e in self.entries] for name in alloc},
            },
        }

    @classmethod
    def from_json(cls, data: Any, *, where: str) -> GroupJournal:
        """Parse :meth:`to_json`'s form; FailedPrecondition naming ``where`` and the fault."""
        try:
            if data.get("format") != JOURNAL_FORMAT or data.get("version") != JOURNAL_VERSION:
                raise ValueError(
                    f"format {data.get('format')!r} v{data.get('version')!r}, "
                    f"expected {JOURNAL_FORMAT!r} v{JOURNAL_VERSION}"
                )
            pools = tuple(
                PoolRecord(_str(p["name"]), _int(p["num_pages"]), _str(p["segment"]), _str(p["incarnation"]))
                for p in data["pools"]
            )
            cols = data["entries"]
            keys, tenants, in_l3 = list(cols["keys"]), list(cols["tenants"]), list(cols["in_l3"])
            pages = {_str(name): list(col) for name, col in cols["pages"].items()}
            if not len(keys) == len(tenants) == len(in_l3) or any(
                len(c) != len(keys) for c in pages.values()
            ):
                raise ValueError("entry columns differ in length")
            entries = tuple(
                EntryRecord(
                    _str(key),
                    {name: _int(col[i]) for name, col in pages.items()},
                    _str(tenants[i]),
                    _bool(in_l3[i]),
                )
                for i, key in enumerate(keys)
            )
            return cls(_str(data["group_id"]), pools, entries)
        except (AttributeError, KeyError, TypeError, ValueError, RecursionError) as exc:
            raise FailedPrecondition(f"warm-restart journal {where} is not valid: {str(exc)[:200]}") from None


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r}")
    return value


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected a boolean, got {value!r}")
    return value


class JournalStore:
    """The journals of one ``shm_prefix`` in one directory (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike[str], prefix: str, *, max_key_bytes: int) -> None:
        """``max_key_bytes`` (``limits.max_key_bytes``) sizes :meth:`bound`."""
        self.directory = Path(directory)
        self.prefix = prefix
        self._max_key_bytes = max_key_bytes
        self._lock_fd: int | None = None
        self._shm_lock = ShmPrefixLock(prefix)
        self._last_stamp_ns = 0

    def path(self, group_id: str) -> Path:
        return self.directory / f"{self.prefix}-{group_id}.json"

    def bound(self, page_counts: Sequence[int]) -> int:
        """The most bytes a journal of a group whose pools have ``page_counts`` pages can
        legitimately take: every page of its largest pool an entry (an entry holds one page of
        each pool) with a key of ``max_key_bytes`` scoped to a tenant, and a tenant name, both
        escaped at worst, one page number per pool; plus the header and the pool records."""
        pools = len(page_counts)
        pages = max(page_counts, default=0)
        per_entry = (
            _ESCAPE * (self._max_key_bytes + _KEY_SCOPE_BYTES + TENANT_BYTES)
            + _ENTRY_BYTES
            + pools * (len(str(pages)) + 1)
        )
        return _HEADER_BYTES + pools * _POOL_BYTES + pages * per_entry

    def lock(self) -> None:
        """Claim the prefix for this process (creates the directory, mode 0700).

        FailedPrecondition if the directory cannot be made or another live
        daemon holds the prefix (two daemons re-mapping one set of segments
        would corrupt each other).
        """
        if self._lock_fd is not None:
            return
        lock_path = self.directory / f"{self.prefix}.lock"
        try:
            self._make_private_directory()
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise FailedPrecondition(
                f"host.journal_dir {str(self.directory)!r} is not usable: {exc}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise FailedPrecondition(
                f"another daemon holds warm-restart prefix {self.prefix!r} ({lock_path}); "
                f"give each daemon its own host.shm_prefix"
            ) from None
        try:
            self._shm_lock.acquire()  # and in /dev/shm: a daemon with another journal_dir
        except BaseException:
            os.close(fd)
            raise
        self._lock_fd = fd
        self._remove_stale_writes()

    def _remove_stale_writes(self) -> None:
        """Remove the temporary files of journal writes a killed daemon of this prefix left
        (SIGKILL at the end of a shutdown's grace period lands in the journal writes, the last
        step): each as large as a journal, they piled up one per kill. Only this prefix's exact
        names (``.<prefix>-<group id>.json.<pid>.tmp``; the lock says nobody writes them now),
        never another prefix's that extends this one."""
        pattern = re.compile(rf"\.{re.escape(self.prefix)}-[0-9a-f]{{16}}\.json\.[0-9]+\.tmp")
        try:
            for entry in os.scandir(self.directory):
                if pattern.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                    logger.warning("removing %s, a journal write a killed daemon left", entry.path)
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
        except OSError as exc:  # a read-only directory, say: the journal writes will say more
            logger.warning("cannot remove stale journal writes in %s: %s", self.directory, exc)

    def _make_private_directory(self) -> None:
        """The directory, mode 0700: journals name tenants and keys, and the next daemon maps
        what they name. One this user owns with wider bits (an earlier version made it 0755)
        is narrowed.

        FailedPrecondition (OSError for the caller) for a directory of another user, or a path
        through a directory or symlink of a user other than root and this one: its
        owner could plant journals (the next daemon replayed them: another tenant's keys mapped
        onto pages of its choice), read them, or re-point the name. Before, another's directory
        was used as it was, and a symlink was followed by the chmod (a root daemon narrowed
        whatever directory it pointed to, /tmp included, to 0700)."""
        _check_ancestors(self.directory)
        self.directory.parent.mkdir(parents=True, exist_ok=True)
        _check_ancestors(self.directory)  # again, now that the parents exist
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.directory, 0o700)
        # Once more now that it exists (a name another user made in a sticky parent between
        # the check and the mkdir is theirs), then open the very directory this walk judged:
        # every symlink on the way is root's or ours, and nobody else can swap what they hold.
        way = _check_ancestors(self.directory)
        if way.final is None or not way.final.directory:
            raise FailedPrecondition(f"host.journal_dir {str(self.directory)!r} is not a directory")
        fd = os.open(way.reached, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (way.final.st.st_dev, way.final.st.st_ino):
                raise FailedPrecondition(
                    f"host.journal_dir {str(self.directory)!r} changed while it was checked; try again"
                )
            if st.st_uid != os.geteuid():
                raise FailedPrecondition(
                    f"host.journal_dir {str(self.directory)!r} is owned by uid {st.st_uid}, not by this "
                    f"daemon's uid {os.geteuid()}: its owner could plant or read journals; remove it "
                    "or choose another directory"
                )
            if stat.S_IMODE(st.st_mode) != 0o700:
                os.fchmod(fd, 0o700)  # mkdir applied the umask; or narrow an old one
        finally:
            os.close(fd)

    def unlock(self) -> None:
        """Release :meth:`lock`. Idempotent."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            self._shm_lock.release()
            os.close(fd)  # closing the descriptor drops the flock

    def write(self, journal: GroupJournal) -> Path:
        """Replace the group's journal atomically; OSError if the disk refuses.

        Its modification time is the write's, strictly later than this store's previous
        write: :meth:`saved` then orders journals as they were written (the kernel's file
        times tick only every few ms, so one shutdown's journals could share one).
        """
        final = self.path(journal.group_id)
        data = json.dumps(journal.to_json(), separators=(",", ":")).encode("utf-8")
        limit = self.bound([p.num_pages for p in journal.pools])
        if len(data) > limit:
            # The next daemon would refuse it (read); keys longer than limits.max_key_bytes, say.
            raise FailedPrecondition(
                f"warm-restart journal {final} would take {len(data)} bytes, over its bound of {limit} "
                "bytes (docs/limits.md)"
            )
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()  # a killed earlier write with this pid (pid 1 in a container, say)
        try:
            # 0600, not the umask's 0644: a journal lists tenants and their keys.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                stamp = self._last_stamp_ns = max(time.time_ns(), self._last_stamp_ns + 1)
                os.utime(f.fileno(), ns=(stamp, stamp))
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
        dir_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return final

    def saved(self) -> dict[str, int]:
        """The group ids that have a journal, with its modification time (ns; see :meth:`write`)."""
        pattern = re.compile(rf"{re.escape(self.prefix)}-([0-9a-f]{{16}})\.json")
        found: dict[str, int] = {}
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.directory):
                m = pattern.fullmatch(entry.name)
                if m and entry.is_file(follow_symlinks=False):
                    found[m.group(1)] = entry.stat(follow_symlinks=False).st_mtime_ns
        return found

    def read(self, group_id: str, page_counts: Sequence[int]) -> GroupJournal | None:
        """The group's journal, or None when there is none. ``page_counts``: the pages of the
        group's pools as the attach asks them, which give the journal's :meth:`bound`.

        FailedPrecondition when it is over its bound (nothing of it read: parsing takes several
        times a file's bytes in memory, and it is another's to plant only where the directory
        checks failed), unreadable, not UTF-8, not JSON, nested too
        deeply, of the wrong types, of another format version or of another group
        (the caller then starts the group cold and removes the journal).
        """
        path = self.path(group_id)
        limit = self.bound(page_counts)
        try:
            raw = _read_own_file(path, limit)
        except FileNotFoundError:
            return None
        except _TooLarge:
            raise FailedPrecondition(
                f"warm-restart journal {path} is larger than its bound of {limit} bytes (docs/limits.md)"
            ) from None
        except OSError as exc:
            raise FailedPrecondition(f"warm-restart journal {path} is unreadable: {exc}") from None
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise FailedPrecondition(
                f"warm-restart journal {path} is not UTF-8 (byte {exc.start}: {exc.reason})"
            ) from None
        except json.JSONDecodeError as exc:
            raise FailedPrecondition(f"warm-restart journal {path} is not JSON: {exc}") from None
        except RecursionError:
            # The json module recurses per nesting level: a hostile or corrupt file must not
            # make every attach of the group fail.
            raise FailedPrecondition(f"warm-restart journal {path} is nested too deeply") from None
        journal = GroupJournal.from_json(data, where=str(path))
        if journal.group_id != group_id:
            raise FailedPrecondition(f"warm-restart journal {path} belongs to group {journal.group_id!r}")
        return journal

    def remove(self, group_id: str) -> None:
        """Delete the group's journal (it is consumed). Idempotent."""
        with contextlib.suppress(FileNotFoundError):
            self.path(group_id).unlink()


def _check_ancestors(directory: Path) -> Walk:
    """The kernel's walk of ``directory``; FailedPrecondition unless every directory and symlink
    on it is root's or this daemon's (:func:`hicached.paths.foreign_in`): their owner could plant
    journals. The journal directory's own mode is checked in ``_make_private_directory``."""
    me = os.geteuid()
    way = walk(str(directory))
    found = foreign_in(way, (me, 0), itself=True)
    if found is not None:
        raise FailedPrecondition(
            f"host.journal_dir {str(directory)!r}: {found.path} on its path is {found.kind} owned by uid "
            f"{found.uid}, who could plant journals or re-point it; use a path owned by root or uid {me}"
        )
    return way


class _TooLarge(Exception):
    """A journal over its bound."""


def _read_own_file(path: Path, limit: int) -> bytes:
    """The bytes of ``path``, a regular file of this daemon's uid: not through a symlink, and
    never blocking on a FIFO (OSError otherwise; FileNotFoundError when there is none).
    _TooLarge when it holds more than ``limit`` bytes, read no further than that."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise OSError(f"not a regular file owned by uid {os.geteuid()}")
        if st.st_size > limit:
            raise _TooLarge
        data = f.read(limit + 1)  # the size may have grown since the fstat
        if len(data) > limit:
            raise _TooLarge
        return data
