"""The keys of each tenant (the default one, "", included) that content indexes wrote to L3,
remembered for ``clear(tenant)``.

L3 object names are content keys, not tenants, so a tenant's copies can only be deleted
by the keys the daemon remembers writing for it. :class:`TenantL3Keys` keeps them for
every content index of a daemon together (the pool groups' registry owns one and hands it
to each group's index), within a bound in bytes for the default tenant's and another for
named tenants' (the default tenant's traffic, usually the bulk, must not crowd theirs
out): the least recently stored keys, of any group, are forgotten beyond it. A forgotten
key's L3 copy is then removed only by a full clear, as are the copies an earlier daemon
wrote.

Before, each index kept up to 262,144 keys of its own, whatever their length: about
160 MB per pool group, times ``host.max_groups`` (64).

Thread-safety: one lock, held only inside these methods, which call nothing else; an
index calls them while holding its own table's lock (this lock is always taken last).
"""

from __future__ import annotations

import collections
import itertools
import sys
import threading
from collections.abc import Iterable

__all__ = ["ENTRY_OVERHEAD_BYTES", "MAX_TENANT_L3_KEY_BYTES", "TenantL3Keys"]

# The bound of one daemon's remembered keys, all groups and tenants together.
MAX_TENANT_L3_KEY_BYTES = 32 << 20

# What remembering one key costs besides its key and tenant strings: the (owner, key) tuple
# and the ordered dict's slot and node. Measured with tracemalloc on CPython 3.11: 140-161
# bytes per entry from 1,000 to 262,144 keys; rounded up, so the bound is not exceeded.
ENTRY_OVERHEAD_BYTES = 192


_Keys = collections.OrderedDict[tuple[int, str], str]


def entry_bytes(key: str, tenant: str) -> int:
    """What remembering ``key`` for ``tenant`` is counted as: both strings as Python holds
    them (a shared tenant string is counted for each key: the bound errs high) plus
    :data:`ENTRY_OVERHEAD_BYTES`."""
    return sys.getsizeof(key) + sys.getsizeof(tenant) + ENTRY_OVERHEAD_BYTES


class TenantL3Keys:
    """(owner, key) -> tenant, least recently stored first, within ``max_bytes`` (default
    :data:`MAX_TENANT_L3_KEY_BYTES`) for the default tenant's keys and as much for named
    tenants' (the attribute is read at each insert, so lowering it takes effect at the next
    one). A key names its tenant (keys are scoped by tenant), so it is in one of the two.

    An owner is one content index's table (:meth:`new_owner`); its keys are its own, so
    the same key stored by two groups is two entries. Thread-safe (see the module)."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = MAX_TENANT_L3_KEY_BYTES if max_bytes is None else max_bytes
        self._lock = threading.Lock()
        # [0]: the default tenant's keys, [1]: named tenants'; each with its bytes counted.
        self._parts: tuple[_Keys, _Keys] = (collections.OrderedDict(), collections.OrderedDict())
        self._bytes = [0, 0]
        self._per_owner = collections.Counter[int]()
        self._owners = itertools.count(1)

    def new_owner(self) -> int:
        """A token for one table's keys (never reused)."""
        return next(self._owners)

    def remember(self, owner: int, key: str, tenant: str) -> None:
        """``owner`` wrote ``key`` of ``tenant`` to L3: remember it as the newest, forgetting
        the oldest (of any owner) beyond the bound."""
        part = int(bool(tenant))
        keys = self._parts[part]
        with self._lock:
            slot = (owner, key)
            old = keys.pop(slot, None)
            if old is not None:
                self._bytes[part] -= entry_bytes(key, old)
            else:
                self._per_owner[owner] += 1
            keys[slot] = tenant
            self._bytes[part] += entry_bytes(key, tenant)
            limit = self.max_bytes
            while self._bytes[part] > limit and keys:
                (gone_owner, gone_key), gone_tenant = keys.popitem(last=False)
                self._bytes[part] -= entry_bytes(gone_key, gone_tenant)
                self._drop_owner_count(gone_owner)

    def of(self, owner: int, tenant: str) -> set[str]:
        """The keys ``owner`` remembers for ``tenant`` (a scan of every remembered key of the
        default tenant, or of named ones: for clears, which are rare)."""
        with self._lock:
            if not self._per_owner[owner]:
                return set()
            keys = self._parts[int(bool(tenant))]
            return {k for (o, k), t in keys.items() if o == owner and t == tenant}

    def forget(self, owner: int, keys: Iterable[str] | None) -> None:
        """Stop remembering ``keys`` of ``owner`` (None: all of its keys)."""
        with self._lock:
            if keys is None:
                if not self._per_owner[owner]:
                    return
                keys = [k for part in self._parts for o, k in part if o == owner]
            for key in keys:
                for part, remembered in enumerate(self._parts):
                    tenant = remembered.pop((owner, key), None)
                    if tenant is not None:
                        self._bytes[part] -= entry_bytes(key, tenant)
                        self._drop_owner_count(owner)

    def _drop_owner_count(self, owner: int) -> None:
        left = self._per_owner[owner] - 1
        if left:
            self._per_owner[owner] = left
        else:
            del self._per_owner[owner]

    def count(self, owner: int | None = None) -> int:
        """Keys remembered (of ``owner``, or of all)."""
        with self._lock:
            return sum(map(len, self._parts)) if owner is None else self._per_owner[owner]

    @property
    def nbytes(self) -> int:
        """Bytes counted for the remembered keys (at most twice :attr:`max_bytes`)."""
        with self._lock:
            return sum(self._bytes)
