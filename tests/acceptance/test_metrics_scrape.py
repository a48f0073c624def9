"""Issue 11 item 2: ``/metrics`` of a daemon started with ``hicached serve`` shows what a
worker did: non-zero ``hicached_host_used_bytes`` for its model and pools, copy counters
labelled with the model, queue depths in the copy engine's own priority vocabulary, and
no background-task failure.

On the code before the fix this fails: ``Daemon.refresh_gauges`` raised on its first tick
(``priority='demand'`` was not in the metrics vocabulary) and the task died silently, so
``hicached_host_*`` never appeared; copy counters carried ``model=""``.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from hicached_client import HiCacheClient, TokenChain, WorkerIdentity
from prometheus_client.parser import text_string_to_metric_families

from hicached.testing.procs import free_ports
from tests.acceptance.cfg_serve import serve
from tests.support.kv import PAGE_SIZE, POOLS, WorkerPools, transfers, unique_tag

MODEL = "acceptance-metrics"
PAGES = 8

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def select(samples: Samples, name: str, **labels: str) -> dict[frozenset[tuple[str, str]], float]:
    want = set(labels.items())
    return {lab: v for (n, lab), v in samples.items() if n == name and want <= lab}


@pytest.fixture
def worker_pools() -> Iterator[WorkerPools]:
    pools = WorkerPools.create(unique_tag("accm"))
    pools.fill_random(5)
    yield pools
    pools.close()


def test_scrape_after_a_worker_wrote_pages(tmp_path: Path, worker_pools: WorkerPools) -> None:
    (port,) = free_ports(1)
    config = f'[host]\nbudget = "256MiB"\n[server]\nmetrics_port = {port}\n[l3]\nbackend = "none"\n'
    served = serve(tmp_path, config)
    try:
        assert f"metrics=http://127.0.0.1:{port}/metrics" in served.log, served.log
        with HiCacheClient(served.target, timeout_s=60.0) as client:
            ident = WorkerIdentity(unique_tag("w"), generation=1, model_name=MODEL)
            with client.attach(ident, worker_pools.specs()) as session:
                chain = TokenChain(list(range(PAGES * PAGE_SIZE)))
                assert session.put_pages(chain, transfers(range(PAGES))).stored_pages == PAGES
                # The gauges refresh once a second: poll the endpoint with a deadline.
                deadline = time.monotonic() + 30
                while True:
                    samples = scrape(port)
                    used = select(samples, "hicached_host_used_bytes", model=MODEL)
                    if used and all(v > 0 for v in used.values()):
                        break
                    assert time.monotonic() < deadline, f"host gauges never filled: {used}"
                    time.sleep(0.2)  # the scrape interval of a poll, not synchronisation
        assert {dict(lab)["pool"] for lab in used} == set(POOLS)
        totals = select(samples, "hicached_host_total_bytes", model=MODEL)
        assert all(totals[lab] >= used[lab] > 0 for lab in used)

        written = select(samples, "hicached_write_bytes_total")
        assert written and all(dict(lab)["model"] == MODEL for lab in written), written
        assert sum(written.values()) > 0
        assert sum(select(samples, "hicached_write_tokens_total", model=MODEL).values()) >= PAGES * PAGE_SIZE

        depths = {dict(lab)["priority"] for lab in select(samples, "hicached_queue_depth")}
        assert depths == {"restore", "demand", "prefetch", "write_back"}
        assert sum(select(samples, "hicached_background_task_failures_total").values()) == 0
        assert "task_failed" not in served.log, served.log
    finally:
        assert served.stop() == 0, served.log
        served.cleanup()
