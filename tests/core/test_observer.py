"""The core's copies feed the daemon's Prometheus metrics through CoreMetrics."""

from __future__ import annotations

from types import MappingProxyType

from hicached.metrics import Metrics
from hicached.observability import CoreMetrics
from hicached.transfer.plan import CopyPlan, Direction


def plan(direction: Direction, tokens: dict[str, int], nbytes: dict[str, int]) -> CopyPlan:
    return CopyPlan(
        direction=direction,
        steps=(),
        nbytes=sum(nbytes.values()),
        tokens_by_pool=MappingProxyType(tokens),
        bytes_by_pool=MappingProxyType(nbytes),
    )


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_copies_are_counted_per_direction_model_and_pool_every_time() -> None:
    metrics = Metrics()
    observer = CoreMetrics(metrics)
    for _ in range(3):  # the second and third calls use the children the first looked up
        observer.on_copy(
            Direction.D2H, plan(Direction.D2H, {"kv": 8, "swa": 4}, {"kv": 80, "swa": 40}), 0.5, "a"
        )
        observer.on_copy(Direction.H2D, plan(Direction.H2D, {"kv": 2}, {"kv": 20}), 0.25, "a")
        observer.on_copy(Direction.D2H, plan(Direction.D2H, {"kv": 1}, {"kv": 10}), 0.5, "b")
    assert sample(metrics, "hicached_write_tokens_total", model="a", pool="kv") == 24
    assert sample(metrics, "hicached_write_bytes_total", model="a", pool="swa") == 120
    assert sample(metrics, "hicached_write_bytes_total", model="b", pool="kv") == 30
    assert sample(metrics, "hicached_load_tokens_total", model="a", pool="kv") == 6
    assert sample(metrics, "hicached_load_bytes_total", model="a", pool="kv") == 60
    assert sample(metrics, "hicached_load_bytes_total", model="b", pool="kv") == 0
    assert sample(metrics, "hicached_transfer_duration_seconds_count", direction="d2h") == 6
    assert sample(metrics, "hicached_transfer_duration_seconds_sum", direction="h2d") == 0.75
