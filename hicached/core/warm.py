"""Warm restart's side of the group registry: the pool groups a clean shutdown journaled.

At startup (:meth:`WarmGroups.start`) the prefix is locked, segments that no journal covers
are unlinked (a crash left them), journals none of whose segments is left are removed (a node
reboot empties ``/dev/shm`` but not ``host.journal_dir``), and the rest are *journaled
groups*. Each keeps its segments and journal until a worker re-creates the group
(:meth:`WarmGroups.take` consumes the journal) or it is dropped (:meth:`WarmGroups.drop`:
segments unlinked, journal removed, logged).

Journaled groups hold ``/dev/shm`` memory, so they count against ``host.budget`` and
``host.max_groups`` as live groups do: at startup the oldest are dropped until the rest fit
both, and the registry drops them, oldest first, before it retires any idle live group to make
room. Before, the groups of models that never came back piled up across restarts, past both
bounds (12 groups and 101 MB of segments after six daemons of a 64 MiB, 2-group node).
"Oldest" is the journal's modification time: a shutdown writes the least recently used
group's journal first.

Thread-safety: none of its own. The registry calls it from its constructor and under its
lock; it owns the journaled groups' segments and journals (nobody maps them meanwhile).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass

from hicached.core.journal import GroupJournal, JournalStore
from hicached.core.types import PoolRequest
from hicached.errors import FailedPrecondition, HiCacheError
from hicached.l2.host_pool import HostKVPool, open_host_pool
from hicached.shm import SHM_DIR, SharedSegment

__all__ = ["GROUP_ID_LIKE", "Journaled", "WarmGroups"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Journaled:
    """A journaled group not yet re-created: its segments, their bytes and when it was saved."""

    group_id: str
    segments: tuple[str, ...]
    nbytes: int
    saved_ns: int


# How a group id starts a segment's name after its prefix (``<prefix>-<group id>-<pool>``).
# No pool name may start so (:func:`hicached.core.attach_checks.validate_pool_requests`): then a name
# whose pool part does belongs to the longer prefix ``<prefix>-<16 hex>``.
GROUP_ID_LIKE = re.compile(r"[0-9a-f]{16}-")


class WarmGroups:
    """The journaled groups of one ``shm_prefix`` (see the module docstring)."""

    def __init__(self, store: JournalStore, *, prefault: bool) -> None:
        self._store = store
        self._prefault = prefault
        self._journaled: dict[str, Journaled] = {}

    def segment_name(self, group_id: str, pool: str) -> str:
        return f"{self._store.prefix}-{group_id}-{pool}"  # no daemon id: the next daemon must find it

    def start(self, *, budget: int, max_groups: int) -> None:
        """Lock the prefix, clean up after crashes and reboots, then drop the oldest journaled
        groups until the rest fit ``budget`` bytes and ``max_groups`` groups.

        FailedPrecondition (from :meth:`JournalStore.lock`) when the prefix is taken.
        """
        self._store.lock()
        saved = self._store.saved()
        segments = self._segments()
        for gid, names in sorted(segments.items()):
            if gid not in saved:
                for name in names:
                    logger.warning("removing segment %s left without a journal (no clean shutdown)", name)
                    _unlink(name)
        for gid, saved_ns in saved.items():
            names = segments.get(gid, [])
            if not names:
                logger.warning(
                    "pool group %s: removing its warm-restart journal, none of its segments is left "
                    "(a reboot empties /dev/shm)",
                    gid,
                )
                self._store.remove(gid)
                continue
            self._journaled[gid] = Journaled(gid, tuple(names), sum(_size(n) for n in names), saved_ns)
        held = self.oldest_first()
        count, used = len(held), sum(j.nbytes for j in held)
        for j in held:
            if count <= max_groups and used <= budget:
                break
            self.drop(
                j.group_id,
                f"the journaled groups exceed host.max_groups={max_groups} or host.budget={budget} bytes",
                level=logging.WARNING,
            )
            count, used = count - 1, used - j.nbytes
        if self._journaled:
            logger.info(
                "%d journaled pool groups (%d bytes) wait for their workers",
                len(self._journaled),
                self.nbytes(),
            )

    def _segments(self) -> dict[str, list[str]]:
        """This prefix's warm-restart segment names by group id. Names of daemons without warm
        restart (``prefix-<daemon id>-...``) never match, nor files that are not regular files
        of this daemon's uid: ``/dev/shm`` is usually writable by every local user, and such a
        file under one of our names is somebody else's (logged, never counted nor unlinked).
        Before, one made a non-root daemon fail to start (its unlink raised EPERM), and a sparse
        one of 1 TiB under a journaled group's id made the daemon drop that group to fit the
        budget."""
        prefix = self._store.prefix
        pattern = re.compile(rf"{re.escape(prefix)}-([0-9a-f]{{16}})-([^/]+)")
        found: dict[str, list[str]] = {}
        with contextlib.suppress(FileNotFoundError):
            for name in sorted(os.listdir(SHM_DIR)):
                m = pattern.fullmatch(name)
                if m and not _another_prefix(name, m.group(2)) and _ours(name):
                    found.setdefault(m.group(1), []).append(name)
        return found

    def oldest_first(self) -> list[Journaled]:
        return sorted(self._journaled.values(), key=lambda j: (j.saved_ns, j.group_id))

    def count(self) -> int:
        return len(self._journaled)

    def nbytes(self) -> int:
        # A copy first: read without the registry's lock (GetStats), which changes the dict.
        return sum(j.nbytes for j in list(self._journaled.values()))

    def drop(self, group_id: str, why: str, *, level: int = logging.INFO) -> None:
        """Unlink a journaled group's segments and remove its journal, logged with ``why``."""
        j = self._journaled.pop(group_id)
        for name in j.segments:
            _unlink(name)
        self._store.remove(group_id)
        logger.log(level, "dropped journaled pool group %s (%d bytes): %s", group_id, j.nbytes, why)

    def take(
        self, gid: str, plan: Sequence[tuple[PoolRequest, int, int]]
    ) -> tuple[GroupJournal, list[HostKVPool]] | None:
        """The group's journal and its re-mapped pools in ``plan`` order (consuming the
        journal), or None and no stale segment of the group's names left.

        Whatever does not match the attach exactly (pool names, page counts,
        segment names, segment headers) or is not the segment the journal describes (its
        incarnation: a daemon of this prefix with another ``host.journal_dir`` re-created it)
        falls back to a fresh group, logged.
        """
        held = self._journaled.pop(gid, None)  # a live group's now, whatever follows
        names = [self.segment_name(gid, p.name) for p, _, _ in plan]
        try:
            journal = self._store.read(gid, [n for _, n, _ in plan])
        except FailedPrecondition as exc:
            logger.warning("pool group %s: %s; starting it cold", gid, exc)
            journal = None
        self._store.remove(gid)  # consumed now: a later crash must never replay it
        opened: list[HostKVPool] = []
        if journal is not None:
            wanted = sorted((p.name, n, seg) for (p, n, _), seg in zip(plan, names, strict=True))
            stored = sorted((r.name, r.num_pages, r.segment) for r in journal.pools)
            if wanted != stored:
                logger.warning(
                    "pool group %s: the warm-restart journal's pools %s do not match the attach's %s; "
                    "starting it cold",
                    gid,
                    stored,
                    wanted,
                )
            else:
                try:
                    for (p, num_pages, _), seg in zip(plan, names, strict=True):
                        opened.append(
                            open_host_pool(
                                p.spec, p.layout, num_pages, segment_name=seg, prefault=self._prefault
                            )
                        )
                except HiCacheError as exc:
                    logger.warning("pool group %s: cannot re-map its pools (%s); starting it cold", gid, exc)
                else:
                    kept = {r.segment: r.incarnation for r in journal.pools}
                    if all(
                        pool.incarnation and pool.incarnation == kept[seg]
                        for pool, seg in zip(opened, names, strict=True)
                    ):
                        return journal, opened
                    # Another daemon of this prefix (another host.journal_dir) made these
                    # segments since the journal was written: its pages are not the journal's.
                    logger.warning(
                        "pool group %s: its segments were re-created since the warm-restart journal "
                        "was written; starting it cold",
                        gid,
                    )
                for pool in opened:
                    pool.close()
                opened = []
        for seg in sorted({*names, *(held.segments if held is not None else ())}):
            if SharedSegment.exists(seg):
                # No usable journal: a crashed daemon's pages may be half written.
                logger.warning("pool group %s: removing segment %s left without a journal", gid, seg)
                _unlink(seg)
        return None

    def unlock(self) -> None:
        self._store.unlock()


def _another_prefix(name: str, rest: str) -> bool:
    """Whether ``<prefix>-<16 hex>-<rest>`` is no segment of this prefix: ``rest`` is itself
    ``<16 hex>-<pool>``, a segment of the prefix ``<prefix>-<16 hex>`` (a prefix may hold
    ``-``), since no pool name of ours starts so (:func:`hicached.core.attach_checks.validate_pool_requests`).
    Such a name is left alone, logged: before, the daemon of prefix ``p`` removed a
    ``p-0123456789abcdef`` daemon's segments at its start (that daemon's next start was cold)."""
    if not GROUP_ID_LIKE.match(rest):
        return False
    logger.info("ignoring %s/%s: a segment of another shm prefix", SHM_DIR, name)
    return True


def _ours(name: str) -> bool:
    """Whether ``/dev/shm/name`` is a regular file owned by this daemon's uid (else logged)."""
    try:
        st = os.lstat(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        return False
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
        return True
    logger.warning(
        "ignoring %s/%s: not a regular file owned by uid %d (uid %d's); it is not this daemon's",
        SHM_DIR,
        name,
        os.geteuid(),
        st.st_uid,
    )
    return False


def _unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass
    except OSError as exc:  # EPERM: another user's file in the sticky /dev/shm
        logger.warning("cannot remove %s/%s: %s", SHM_DIR, name, exc.strerror)


def _size(name: str) -> int:
    try:
        return os.lstat(os.path.join(SHM_DIR, name)).st_size
    except FileNotFoundError:
        return 0
