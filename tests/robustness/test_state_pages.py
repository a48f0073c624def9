"""Host pages against a real daemon: a failed call changes nothing (pools, ownership, the
content index), ReleaseTransfers skips derived entries by role, Publish checks page ranges."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import grpc
import pytest
from hicached_client import HiCacheClient, HiCacheError, PageBytes, Session, Transfer, WorkerIdentity

from tests.robustness.state_support import device_pools, no_retry_client, specs, state
from tests.support.daemon import Daemon


@pytest.fixture
def client(daemon: Daemon) -> Iterator[HiCacheClient]:
    with no_retry_client(daemon.target) as c:
        yield c


@pytest.fixture
def session(client: HiCacheClient) -> Iterator[Session]:
    with device_pools() as device:
        s = client.attach(
            WorkerIdentity(f"w-{uuid.uuid4().hex[:8]}", 1, f"m-{uuid.uuid4().hex[:8]}"), specs(device)
        )
        try:
            yield s
        finally:
            s.close()


def _total(session: Session, pool: str) -> int:
    return next(p.total_pages for p in session.info.pools if p.name == pool)


def _put(session: Session, prefix: str, n: int) -> None:
    sizes = {p.name: p.page_bytes for p in session.info.pools if p.name in ("kv", "swa")}
    body = [
        PageBytes(f"{prefix}{i}", pool, bytes([i % 251]) * sizes[pool]) for i in range(n) for pool in sizes
    ]
    assert session.put_bytes(body).stored_pages == n


@pytest.mark.parametrize("derived_first", [True, False], ids=["derived-first", "derived-second"])
def test_a_derived_release_leaves_every_pool_exactly_as_before(
    client: HiCacheClient, session: Session, derived_first: bool
) -> None:
    """Fails before the fix: listed first, the call failed with FAILED_PRECONDITION after
    dropping the session's ownership of kv's pages (leaked until the group goes away);
    listed second, it freed kv's pages and still failed."""
    before = state(client)
    got = session.resolve_transfers(
        [Transfer("kv", list(range(3))), Transfer("swa", list(range(3))), Transfer("draft", [])]
    )
    assert got.ok
    by_pool = {t.pool: t for t in got.transfers}
    draft = Transfer("draft", by_pool["draft"].device_pages, by_pool["draft"].host_pages, host_allocated=True)
    rest = [by_pool["kv"], by_pool["swa"]]
    freed = session.release_transfers([draft, *rest] if derived_first else [*rest, draft])
    assert freed == 6
    assert state(client) == before


def test_a_put_bytes_that_cannot_fit_leaves_the_index_and_pages_unchanged(
    client: HiCacheClient, session: Session
) -> None:
    """Fails before the fix: it evicted the published pages first (index 2 -> 0), then failed."""
    _put(session, "cached", 2)
    before = state(client)
    assert session.stats().groups[0].indexed_pages == 2
    sizes = {p.name: p.page_bytes for p in session.info.pools if p.name in ("kv", "swa")}
    n = _total(session, "kv") + 1
    big = [PageBytes(f"big{i}", pool, b"\x07" * sizes[pool]) for i in range(n) for pool in sizes]
    with pytest.raises(HiCacheError) as err:
        session.put_bytes(big)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert state(client) == before


def test_a_resolve_that_cannot_fit_evicts_nothing(client: HiCacheClient, session: Session) -> None:
    """Fails before the fix: the anchor was allocated, the sidecar's reclaim emptied the cache,
    and the resolve still answered ok=False."""
    _put(session, "cached", 2)
    held = session.alloc("swa", _total(session, "swa") - 2)
    assert held.ok
    before = state(client)
    got = session.resolve_transfers(
        [Transfer("kv", list(range(3))), Transfer("swa", list(range(3))), Transfer("draft", [])]
    )
    assert not got.ok
    assert state(client) == before


@pytest.mark.parametrize(
    ("page", "code"),
    [(10**6, grpc.StatusCode.OUT_OF_RANGE), (-1, grpc.StatusCode.INVALID_ARGUMENT)],
    ids=["beyond", "negative"],
)
def test_publish_of_an_out_of_range_host_page_is_precise_and_changes_nothing(
    client: HiCacheClient, session: Session, page: int, code: grpc.StatusCode
) -> None:
    """Fails before the fix: an IndexError (INTERNAL) beyond the pool; a negative page wrapped
    and tested the last page of the pool."""
    swa = session.alloc("swa", 1)
    assert swa.ok
    before = state(client)
    with pytest.raises(HiCacheError) as err:
        session.publish(["k0"], [Transfer("kv", [], [page]), Transfer("swa", [], list(swa.host_pages))])
    assert err.value.code == code, err.value
    assert state(client) == before
