"""The keys a daemon remembers for tenant clears are bounded once for all its pool groups.

Before: each group's index kept up to 262,144 keys of its own (about 160 MB per group as a
reviewer measured, up to ``host.max_groups`` = 64 groups), while docs/limits.md promised
about 40 MB for all tenants together. In-process core over real pools and the file L3.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from hicached.core.tenants import scoped_keys
from hicached.index.tenant_keys import TenantL3Keys, entry_bytes
from hicached.l3 import create_backend
from tests.core.conftest import Core

TENANT = "t"
KEYS = 48  # per group; the bound below holds 40


def _store_tenant_pages(c: Core, sid: str, tag: str) -> None:
    """``KEYS`` pages of ``TENANT`` put, backed up to L3, then evicted from L2 (so a tenant
    clear finds their L3 copies only through the keys the daemon remembers)."""
    _, state = c.core.session_group(sid)
    keys = [f"{tag}{i:04d}" for i in range(KEYS)]
    c.put(sid, keys)
    assert state.index is not None
    state.index.flush(timeout_s=30)  # write_through: every page is in L3 now
    assert c.keyed.lookup(sid, keys).total_hit_pages == KEYS
    state.index.reclaim("kv", state.pool("kv").num_pages)
    assert c.keyed.lookup(sid, keys).l2_hit_pages == 0


def test_one_bound_holds_the_tenant_keys_of_every_group_together(
    make_core: Callable[..., Core], tmp_path: Path
) -> None:
    """Fails before the fix: there was no daemon-wide store (hicached.index.tenant_keys); each
    group's index kept its own keys, so the two groups below remembered 2 x 48."""
    backend = create_backend("file", {"path": str(tmp_path / "l3")})
    try:
        c = make_core(l3=backend)
        store = c.core.groups.tenant_keys  # the daemon's: every group's index remembers here
        store.max_bytes = 40 * entry_bytes(scoped_keys(TENANT, ["a-0000"])[0], TENANT)
        a = c.attach("wa", model="m-a", tenant=TENANT, derived=False, ratio=1.0)
        b = c.attach("wb", model="m-b", tenant=TENANT, derived=False, ratio=1.0)
        assert c.core.session_group(a)[1] is not c.core.session_group(b)[1], "two pool groups"

        _store_tenant_pages(c, a, "a-")
        assert store.count() == 40 and store.nbytes <= store.max_bytes
        _store_tenant_pages(c, b, "b-")
        # Both groups' keys count against the one bound: b's newer keys pushed out all of a's.
        assert store.count() == 40 and store.nbytes <= store.max_bytes

        # What a tenant clear can still reach in L3: b's newest 40, none of a's.
        assert c.keyed.clear("m-a", TENANT) == (0, 0)
        assert c.keyed.clear("m-b", TENANT) == (0, 40)
        assert store.count() == 0
    finally:
        backend.close()


def test_the_default_tenants_keys_do_not_crowd_out_named_tenants() -> None:
    """Fails before (a review of the change that remembered the default tenant's keys): one
    bound for both, so the default tenant's writes, usually the bulk, made the daemon forget a
    named tenant's keys, whose clear then left their L3 copies."""
    store = TenantL3Keys(max_bytes=100 * entry_bytes("k-00000", "t"))
    owner = store.new_owner()
    store.remember(owner, "named-key", "team-a")
    for i in range(1000):
        store.remember(owner, f"k-{i:05d}", "")
    assert store.of(owner, "team-a") == {"named-key"}
    assert len(store.of(owner, "")) <= 100  # its own bound still holds
    assert store.nbytes <= 2 * store.max_bytes
    store.forget(owner, None)
    assert store.count() == 0 and store.nbytes == 0
