"""A copy a session queued before it published the page, and the page's next owner.

A session's Write or Load marks its host pages in flight; a Free of them waits for the copy.
But a page the session then published belongs to the content index, and the index freed
pages straight to the allocator (a clear, an eviction): the queued copy then ran on a page
another tenant had been given. A review's attacker (tenant ``mallory``) read a victim's
(``alice``) KV into its own device memory that way, and with a Write instead overwrote the
victim's published page. The daemon here holds the first copy it runs until the test says so,
so the attacker's Load is queued for as long as the steps need, without timing games.
"""

from __future__ import annotations

import os
import threading
import uuid

import torch
from hicached_client import HiCacheClient, Transfer, WorkerIdentity

from tests.fastlane.conftest import free_pages
from tests.support.faults import log_lines, serve_patched
from tests.support.kv import WorkerPools, unique_tag
from tests.support.state import poll

# The daemon's first copy waits for a line on stdin; "COPYING" says it is held.
HELD_FIRST_COPY = """
import sys
import hicached.transfer.engine as e
_run = e.CopyEngine.run
_held = []
def run(self, *args, **kwargs):
    if not _held:
        _held.append(True)
        print("COPYING", flush=True)
        sys.stdin.readline()
    return _run(self, *args, **kwargs)
e.CopyEngine.run = run
"""

MODEL = "m-copy-race"


def both(pages: list[int], host: list[int] | None = None) -> list[Transfer]:
    return [Transfer("kv", pages, host), Transfer("draft", pages, host)]


def test_a_page_published_under_a_queued_copy_is_not_given_to_another_tenant() -> None:
    """Fails before: the clear freed the attacker's published pages at once (free pages +1 per
    pool while its Load was still queued on them), the victim's next page was one of them,
    and the released Load copied the victim's KV into the attacker's device page."""
    read, release = os.pipe()
    daemon = serve_patched(HELD_FIRST_COPY, stdin=read)
    os.close(read)
    mallory_pools, alice_pools = WorkerPools.create(unique_tag("mal")), WorkerPools.create(unique_tag("ali"))
    loader: threading.Thread | None = None
    try:
        with HiCacheClient(daemon.target, timeout_s=30.0) as client:
            mallory = client.attach(
                WorkerIdentity(f"m-{uuid.uuid4().hex[:6]}", 1, MODEL, tenant="mallory"), mallory_pools.specs()
            )
            alice = client.attach(
                WorkerIdentity(f"a-{uuid.uuid4().hex[:6]}", 1, MODEL, tenant="alice"), alice_pools.specs()
            )
            mallory_pools.clobber()
            held = mallory.resolve_transfers(both([0]))  # host pages P, owned by mallory
            hosts = {t.pool: list(t.host_pages or ()) for t in held.transfers}
            loaded: list[object] = []
            loader = threading.Thread(
                target=lambda: loaded.append(
                    mallory.load_wait([Transfer(p, [5], h) for p, h in hosts.items()])
                )
            )
            loader.start()
            poll(lambda: log_lines(daemon, "COPYING"), bool, 30.0, "the attacker's Load queued on P")

            mallory.publish([uuid.uuid4().hex], list(held.transfers))  # P now the index's
            before = free_pages(mallory)
            client.clear_namespace(
                MODEL, "mallory", session_id=mallory.session_id, session_secret=mallory.info.session_secret
            )
            assert free_pages(mallory) == before, "a page under a queued copy is not free yet"

            alice_pools.fill_random(7)
            secret = alice_pools.pages("kv", [1]).clone()
            assert alice.put_pages([uuid.uuid4().hex], both([1])).stored_pages == 1
            os.write(release, b"go\n")
            loader.join(timeout=30)
            assert loaded, "the attacker's Load ended"
            assert not torch.equal(mallory_pools.pages("kv", [5]), secret), (
                "the victim's KV reached the attacker"
            )
            after = free_pages(mallory)
            assert after == before, "P came back once the Load ended; alice's page is the index's"

    finally:
        os.close(release)
        if loader is not None:
            loader.join(timeout=30)
        daemon.stop()
        mallory_pools.close()
        alice_pools.close()
