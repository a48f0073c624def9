"""The index feeds the daemon's Prometheus metrics through IndexMetrics."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from hicached.errors import Unavailable
from hicached.index import ContentIndex, PrefetchPolicy, PrefetchState
from hicached.l2 import HostPoolGroup
from hicached.l3 import StorageBackend, create_backend
from hicached.metrics import Metrics
from hicached.observability import IndexMetrics
from tests.support.state import poll

from .conftest import PAGE_SIZE, FailingSets, keys_of, write_pages


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_lookup_backup_eviction_and_prefetch_are_counted(
    make_group: Callable[..., HostPoolGroup],
    make_index: Callable[..., ContentIndex],
    file_backend: StorageBackend,
) -> None:
    metrics = Metrics()
    group = make_group(8)
    observer = IndexMetrics(metrics, backend="file", page_size=PAGE_SIZE)
    index = make_index(group, file_backend, observer=observer)
    keys = keys_of("m", 6)
    index.publish(keys, write_pages(group, 6, seed=1))
    index.flush(timeout_s=30)
    page_bytes = group.anchor.host_pool.page_bytes
    assert sample(metrics, "hicached_backup_pages_total", backend="file") == 6
    assert sample(metrics, "hicached_backup_bytes_total", backend="file") == 6 * page_bytes
    assert sample(metrics, "hicached_backuped_tokens_total", backend="file") == 6 * PAGE_SIZE

    assert index.reclaim("kv", 4) == 4
    assert sample(metrics, "hicached_evicted_tokens_total", tier="l2", reason="lru") == 4 * PAGE_SIZE

    index.lookup([*keys, "absent"])
    assert sample(metrics, "hicached_lookup_query_pages_total") == 7
    assert sample(metrics, "hicached_lookup_hit_pages_total", tier="l2") == 2
    assert sample(metrics, "hicached_lookup_hit_pages_total", tier="l3") == 4

    task = index.prefetch(keys, policy=PrefetchPolicy.WAIT_COMPLETE)
    assert task.wait().state is PrefetchState.DONE
    assert sample(metrics, "hicached_prefetch_pages_total", backend="file") == 4
    assert sample(metrics, "hicached_prefetch_batch_pages_count", backend="file") == 1


def test_pages_l3_refuses_count_as_dropped(
    make_group: Callable[..., HostPoolGroup], make_index: Callable[..., ContentIndex], tmp_path: Path
) -> None:
    """Fails before: a batch L3 answered without taking its pages (a full Redis) moved no
    metric; only batches that raised counted."""
    metrics = Metrics()
    backend = FailingSets(create_backend("file", {"path": str(tmp_path / "l3")}))
    group = make_group(8)
    index = make_index(group, backend, observer=IndexMetrics(metrics, backend="file", page_size=PAGE_SIZE))
    index.publish(keys_of("r", 3), write_pages(group, 3, seed=2))
    poll(lambda: index.stats().backup_failed_pages, lambda n: n == 3, 30.0, "the refused batch")
    assert sample(metrics, "hicached_dropped_tokens_total", reason="backup_failed") == 3 * PAGE_SIZE
    with pytest.raises(Unavailable):  # a flush tries them again, and says L3 refused them
        index.flush(timeout_s=30)
    assert sample(metrics, "hicached_dropped_tokens_total", reason="backup_failed") == 6 * PAGE_SIZE
    backend.inner.close()
