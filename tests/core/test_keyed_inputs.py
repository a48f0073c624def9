"""Keyed calls refuse bad input before any allocation or eviction, and quote the client's keys.

A review (stop 41) found PutBytes checking its keys only at publish, after its allocation had
evicted other tenants' entries from a full pool, and allocating for keys L2 already held; its
key dedup was quadratic and its batch limit checked after it; Publish kept the last of two
transfers of one pool and skipped unknown pools; errors quoted the tenant-scoped key (with the
tenant's tag). In-process core; each test fails on the code before.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from hicached.errors import InvalidArgument, NotFound
from hicached.l2.group import PoolTransfer
from tests.core.conftest import Core


def _full(c: Core, sid: str, prefix: str = "k") -> int:
    """Every page of the session's group published under ``prefix<i>``; how many."""
    total = c.pools(sid)["kv"][1]
    c.put(sid, [f"{prefix}{i}" for i in range(total)])
    assert c.indexed(sid) == total and c.pools(sid)["kv"][0] == 0
    return total


def _body(c: Core, sid: str, keys: list[str]) -> list[tuple[str, str, bytes]]:
    _, state = c.core.session_group(sid)
    return [(k, p, b"\x07" * state.pool(p).page_bytes) for k in keys for p in ("kv", "swa")]


def test_a_put_bytes_with_a_bad_key_evicts_nothing(make_core: Callable[..., Core]) -> None:
    c = make_core()
    owner = c.attach("owner", derived=False, tenant="b")
    total = _full(c, owner)
    stranger = c.attach("stranger", derived=False, tenant="a")
    with pytest.raises(InvalidArgument) as info:
        c.keyed.put_bytes(stranger, "", _body(c, stranger, ["fresh", "bad/0"]))
    assert "'bad/0'" in str(info.value) and "~" not in str(info.value), "the client's key, not the scoped one"
    assert c.indexed(owner) == total


def test_a_put_bytes_of_cached_keys_evicts_nothing(make_core: Callable[..., Core]) -> None:
    c = make_core()
    sid = c.attach(derived=False)
    total = _full(c, sid)
    assert c.keyed.put_bytes(sid, "", _body(c, sid, ["k0", "k1"])) == (0, 2)
    assert c.indexed(sid) == total
    resident = c.core.session_group(sid)[1].index
    assert resident is not None and all(resident.l2_resident([f"k{i}" for i in range(total)]))


class _CountOnly(list[tuple[str, str, bytes]]):
    """A request whose pages may be counted but not walked."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        raise AssertionError("per-page work before the count was checked")


def test_a_put_bytes_past_the_batch_is_refused_before_any_per_page_work(
    make_core: Callable[..., Core],
) -> None:
    """One more page than ``server.max_batch_pages`` keys of every pool may carry: refused on
    its count. Before, the pages were walked first, deduplicating keys over a list (with a
    group of 4-byte pages, 65,536 keys took ~30 s of the daemon's CPU, the GIL held), and
    the batch limit refused the call only after that."""
    c = make_core()
    sid = c.attach(derived=False)
    most = c.core.config.server.max_batch_pages
    body = _CountOnly([("k", "kv", b"")] * (2 * most + 1))
    with pytest.raises(InvalidArgument, match=rf"{2 * most + 1} pages exceed server\.max_batch_pages={most}"):
        c.keyed.put_bytes(sid, "", body)


def test_publish_refuses_a_pool_named_twice_or_unknown(make_core: Callable[..., Core]) -> None:
    c = make_core()
    sid = c.attach(derived=False)
    held = {p: c.core.alloc(sid, "", p, 2) for p in ("kv", "swa")}
    assert all(v is not None for v in held.values())
    kv, swa = (np.asarray(held[p]) for p in ("kv", "swa"))
    twice = [PoolTransfer("kv", host_indices=np.array([0, 1])), PoolTransfer("kv", host_indices=kv)]
    with pytest.raises(InvalidArgument, match="appears twice"):
        c.keyed.publish(sid, "", ["a", "b"], [*twice, PoolTransfer("swa", host_indices=swa)])
    unknown = [
        PoolTransfer("kv", host_indices=kv),
        PoolTransfer("swa", host_indices=swa),
        PoolTransfer("extra", host_indices=kv),
    ]
    with pytest.raises(NotFound, match="unknown pool 'extra'"):
        c.keyed.publish(sid, "", ["a", "b"], unknown)
    assert c.indexed(sid) == 0 and c.owned(sid) == 4  # nothing changed hands
    assert c.keyed.publish(sid, "", ["a", "b"], unknown[:2]) == (2, 0)


@pytest.mark.parametrize("call", ["lookup", "publish"])
def test_a_named_tenants_errors_quote_the_clients_keys(make_core: Callable[..., Core], call: str) -> None:
    """ "" was accepted for a named tenant's Lookup (scoped, it read "~<tag>"), and a Publish's
    repeated key was quoted with the tenant's tag appended."""
    c = make_core()
    sid = c.attach(derived=False, tenant="t")
    with pytest.raises(InvalidArgument) as info:
        if call == "lookup":
            c.keyed.lookup(sid, ["a", ""])
        else:
            held = [
                PoolTransfer(p, host_indices=np.asarray(c.core.alloc(sid, "", p, 2))) for p in ("kv", "swa")
            ]
            c.keyed.publish(sid, "", ["k1", "k1"], held)
    assert ("''" if call == "lookup" else "'k1'") in str(info.value) and "~" not in str(info.value), str(
        info.value
    )


def test_get_bytes_counts_its_hit_run_as_get_pages_does(make_core: Callable[..., Core]) -> None:
    """A repeated key counted once: ["p1", "p1", "p2"] answered 6 pages and hit_pages=2."""
    c = make_core()
    sid = c.attach(derived=False)
    assert c.keyed.put_bytes(sid, "", _body(c, sid, ["p1", "p2"])) == (2, 0)
    hit, pages = c.keyed.get_bytes(sid, ["p1", "p1", "p2"], include_l3=False)
    assert (hit, len(pages)) == (3, 6)
