"""Issue 5: ``/metrics`` after a bench-like workload shows the data-plane and L3 counters moving.

Daemon A stores a prefix and backs it up to the file L3, then stops; daemon B starts on the
same L3 directory with ``/metrics`` on a free port and runs the workload: write (D2H), load
(H2D), put_pages, backup(wait) and a prefetch of A's prefix, which only L3 holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import grpc
import pytest
from hicached_client import HiCacheClient, HiCacheError, PrefetchState, TokenChain, WorkerIdentity

from tests.daemon.conftest import free_port, fresh_scrape, new_pools, scrape, start_file_daemon, total
from tests.robustness.loop_support import attach_bytes
from tests.support.daemon import start_daemon
from tests.support.kv import PAGE_SIZE, POOLS, WorkerPools, host_pages_of, transfers
from tests.support.state import poll

MODEL = "m-metrics"
PAGES = 32


def chain(salt: str, offset: int = 0) -> TokenChain:
    return TokenChain(list(range(offset, offset + PAGES * PAGE_SIZE)), cache_salt=salt)


def test_metrics_after_a_bench_like_workload(l3_dir: Path, worker_pools: list[WorkerPools]) -> None:
    old_prefix = chain("tenant-old")
    tag_a, pools_a = new_pools(worker_pools, seed=51)
    first = start_file_daemon(l3_dir)
    try:
        with HiCacheClient(first.target, timeout_s=30.0) as client:
            ident = WorkerIdentity(tag_a, generation=1, model_name=MODEL)
            with client.attach(ident, pools_a.specs()) as a:
                assert a.put_pages(old_prefix, transfers(range(PAGES))).stored_pages == PAGES
                backed = a.backup(old_prefix, wait=True)
                assert backed.stored_pages == backed.queued_pages
    finally:
        first.stop()

    port = free_port()
    tag_b, pools_b = new_pools(worker_pools, seed=52)
    second = start_file_daemon(l3_dir, "--metrics-port", str(port))
    try:
        with HiCacheClient(second.target, timeout_s=30.0) as client:
            ident = WorkerIdentity(tag_b, generation=1, model_name=MODEL)
            with client.attach(ident, pools_b.specs()) as b:
                before = scrape(port)
                assert total(before, "hicached_write_bytes_total") == 0
                src, dst = list(range(PAGES)), list(range(500, 500 + PAGES))
                written = b.write(transfers(src), allocate=True)
                assert written.ok
                host: dict[str, Sequence[int]] = dict(host_pages_of(written.transfers))
                loaded = b.load_wait(transfers(dst, host))
                for pool in POOLS:
                    assert pools_b.digest(pool, dst) == pools_b.digest(pool, src), pool
                after_copy = fresh_scrape(port, client)
                # The counters count exactly the bytes the daemon acknowledged moving.
                assert (
                    total(after_copy, "hicached_write_bytes_total") == sum(a.bytes for a in written.acks) > 0
                )
                assert total(after_copy, "hicached_load_bytes_total") == sum(a.bytes for a in loaded.acks) > 0
                for pool in POOLS:
                    assert total(after_copy, "hicached_write_bytes_total", pool=pool) > 0, pool

                new_prefix = chain("tenant-new", offset=7)
                assert b.put_pages(new_prefix, transfers(range(100, 100 + PAGES))).stored_pages == PAGES
                # A put checks only what L2 holds: it asks no L3 and is not counted as a lookup
                # (it was, and the hit rate fell with every put).
                asked = "hicached_lookup_query_pages_total"
                assert total(fresh_scrape(port, client), asked) == total(after_copy, asked)
                backed = b.backup(new_prefix, wait=True)
                assert backed.stored_pages == backed.queued_pages

                seen = b.lookup(old_prefix)
                assert (seen.l2_hit_pages, seen.total_hit_pages) == (0, PAGES), "only L3 holds A's prefix"
                ticket = b.prefetch(old_prefix, policy="wait_complete")
                assert ticket.planned_pages == PAGES
                status = b.prefetch_status(ticket.prefetch_id, wait=True)
                assert (status.state, status.completed_pages) == (PrefetchState.DONE, PAGES)
                assert b.lookup(old_prefix).l2_hit_pages == PAGES

                end = fresh_scrape(port, client)
                assert total(end, "hicached_write_bytes_total") > total(
                    after_copy, "hicached_write_bytes_total"
                )
                assert total(end, "hicached_load_bytes_total") > 0
                assert total(end, "hicached_backup_pages_total") >= PAGES
                assert total(end, "hicached_prefetch_pages_total") >= PAGES
                assert total(end, "hicached_rpcs_total", method="Write", code="OK") >= 1
                assert total(end, "hicached_rpcs_total", method="Attach", code="OK") == 1
                assert total(end, "hicached_lookup_hit_pages_total", tier="l3") >= PAGES
                assert total(end, "hicached_sessions") == 1
                # Fails before (a review of stop 47): the L3 directions of the transfer histogram
                # were registered at start and never observed (each backup and prefetch batch is).
                for direction in ("l2_to_l3", "l3_to_l2"):
                    batches = total(end, "hicached_transfer_duration_seconds_count", direction=direction)
                    assert batches >= 1, direction

                # Fails before (a review of stop 46): the L3 read counters and the retraction
                # gauge were registered but never set, so they stayed absent or 0.
                held = b.retract_backup("req-metrics", transfers(range(4)), 4 * PAGE_SIZE)
                [backend] = b.stats().backends  # GetStats refreshes the daemon's L3 figures
                assert backend.hits >= PAGES, backend

                def l3_caught_up(s: dict[tuple[str, frozenset[tuple[str, str]]], float]) -> bool:
                    counted = (
                        total(s, f"hicached_l3_{what}_total", backend="file")
                        for what in ("hits", "misses", "corrupt_pages")
                    )
                    return tuple(counted) == (backend.hits, backend.misses, backend.corrupt_pages)

                # The gauges move once a second, the L3 counters when GetStats refreshed them:
                # scrape until a render shows both (one render could show the counters first).
                poll(
                    lambda: fresh_scrape(port, client),
                    lambda s: l3_caught_up(s) and total(s, "hicached_retraction_backups") == 1,
                    10.0,
                    "the L3 counters and the retraction gauge",
                )
                b.retract_discard(held.backup_id)
                poll(
                    lambda: fresh_scrape(port, client),
                    lambda s: total(s, "hicached_retraction_backups") == 0,
                    10.0,
                    "the retraction gauge after the discard",
                )
    finally:
        second.stop()


def test_a_retired_groups_write_series_leave_the_scrape(worker_pools: list[WorkerPools]) -> None:
    """Model and pool names are the clients': before, each (model, pool) that ever wrote kept
    its write/load series in every scrape after its group was retired (a client cycling model
    names grew /metrics by 2.5 KB per cycle, without bound)."""
    port = free_port()
    daemon = start_daemon("--metrics-port", str(port), "--set", "host.max_groups=1")
    try:
        tag, pools = new_pools(worker_pools, seed=71)
        gone = f"m-gone-{tag}"

        def series() -> int:
            return sum(
                1 for (n, lab) in scrape(port) if n == "hicached_write_bytes_total" and ("model", gone) in lab
            )

        with HiCacheClient(daemon.target, timeout_s=30.0) as client:
            with client.attach(WorkerIdentity(tag, generation=1, model_name=gone), pools.specs()) as session:
                assert session.write(transfers(range(2)), allocate=True).ok
            assert series() == len(POOLS)
            # Another model's group: with host.max_groups=1 the idle one of `gone` is retired.
            attach_bytes(client, f"m-next-{tag}", lease_ms=60_000).detach()
            poll(series, lambda n: n == 0, 15.0, "the retired group's write series to leave the scrape")
    finally:
        daemon.stop()


def test_a_lane_record_refused_in_its_parse_is_counted_under_its_opcode(
    worker_pools: list[WorkerPools],
) -> None:
    """Fails before (a review of stop 47): a fast-lane Lookup over ``limits.max_keys_per_request``
    (refused while its record is read) was counted as ``FastLaneUnknown``, the label of an
    unknown opcode, where gRPC counts the same refusal under ``Lookup``."""
    port = free_port()
    daemon = start_daemon("--metrics-port", str(port), "--set", "limits.max_keys_per_request=64")
    tag, pools = new_pools(worker_pools, seed=53)
    try:
        ident = WorkerIdentity(tag, generation=1, model_name=MODEL)
        with (
            HiCacheClient(daemon.target, timeout_s=30.0, fast_lane=True) as client,
            client.attach(ident, pools.specs()) as s,
        ):
            s.lookup(["k"])  # opens the session's lane
            with pytest.raises(HiCacheError) as refused:
                s.lookup([f"k{i}" for i in range(100)])
            assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            seen = fresh_scrape(port, client)
        lookups = total(seen, "hicached_rpcs_total", method="FastLaneLookup")
        assert total(seen, "hicached_rpcs_total", method="FastLaneLookup", code="RESOURCE_EXHAUSTED") == 1
        assert lookups == 2 and total(seen, "hicached_rpcs_total", method="FastLaneUnknown") == 0
    finally:
        daemon.stop()
