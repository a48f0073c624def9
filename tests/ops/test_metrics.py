"""hicached.metrics: a real /metrics endpoint scraped over HTTP."""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from hicached.errors import InvalidArgument
from hicached.metrics import DURATION_BUCKETS, PRIORITIES, TIERS, Metrics, MetricsServer, serve_metrics

# Labels that would make cardinality unbounded (one series per request).
FORBIDDEN_LABEL_PARTS = ("session", "request", "op_id", "operation", "page", "key", "id")


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


@pytest.fixture
def served() -> Iterator[tuple[Metrics, MetricsServer]]:
    metrics = Metrics()
    endpoint = serve_metrics(metrics, "127.0.0.1", 0)
    yield metrics, endpoint
    endpoint.close()


def test_scrape_reports_what_was_counted(served: tuple[Metrics, MetricsServer]) -> None:
    metrics, endpoint = served
    kv = {"model": "llama-8b", "pool": "kv"}
    metrics.host_total_tokens.labels(**kv).set(4096)
    metrics.host_used_tokens.labels(**kv).set(1024)
    metrics.write_bytes.labels(**kv).inc(65536)
    metrics.write_bytes.labels(**kv).inc(65536)
    metrics.load_tokens.labels(**kv).inc(64)
    metrics.evicted_tokens.labels(tier="l2", reason="capacity").inc(128)
    metrics.l3_hits.labels(backend="file").inc(3)
    metrics.l3_misses.labels(backend="file").inc(1)
    metrics.lookup_query_pages.inc(10)
    metrics.lookup_hit_pages.labels(tier=Metrics.tier("l2")).inc(6)
    metrics.rpcs.labels(method="Write", code=Metrics.code("OK")).inc()
    metrics.rpcs.labels(method="Write", code=Metrics.code("RESOURCE_EXHAUSTED")).inc(2)
    metrics.transfer_duration.labels(direction=Metrics.direction("d2h")).observe(3e-5)
    metrics.transfer_duration.labels(direction="d2h").observe(0.2)
    metrics.queue_depth.labels(priority=Metrics.priority("prefetch")).set(7)
    metrics.sessions.inc()

    got = scrape(endpoint.port)

    lab = tuple(sorted(kv.items()))
    assert got[("hicached_host_total_tokens", lab)] == 4096
    assert got[("hicached_host_used_tokens", lab)] == 1024
    assert got[("hicached_write_bytes_total", lab)] == 131072
    assert got[("hicached_load_tokens_total", lab)] == 64
    assert got[("hicached_evicted_tokens_total", (("reason", "capacity"), ("tier", "l2")))] == 128
    assert got[("hicached_l3_hits_total", (("backend", "file"),))] == 3
    assert got[("hicached_l3_misses_total", (("backend", "file"),))] == 1
    assert got[("hicached_lookup_query_pages_total", ())] == 10
    assert got[("hicached_lookup_hit_pages_total", (("tier", "l2"),))] == 6
    assert got[("hicached_rpcs_total", (("code", "OK"), ("method", "Write")))] == 1
    assert got[("hicached_rpcs_total", (("code", "RESOURCE_EXHAUSTED"), ("method", "Write")))] == 2
    d2h = (("direction", "d2h"),)
    assert got[("hicached_transfer_duration_seconds_count", d2h)] == 2
    assert got[("hicached_transfer_duration_seconds_sum", d2h)] == pytest.approx(0.20003)
    assert got[("hicached_transfer_duration_seconds_bucket", (*d2h, ("le", "5e-05")))] == 1
    assert got[("hicached_transfer_duration_seconds_bucket", (*d2h, ("le", "0.25")))] == 2
    assert got[("hicached_queue_depth", (("priority", "prefetch"),))] == 7
    assert got[("hicached_sessions", ())] == 1


def test_closed_vocabularies_exist_at_zero_before_any_event(served: tuple[Metrics, MetricsServer]) -> None:
    _, endpoint = served
    got = scrape(endpoint.port)
    for tier in TIERS:
        assert got[("hicached_lookup_hit_pages_total", (("tier", tier),))] == 0
    for priority in PRIORITIES:
        assert got[("hicached_queue_depth", (("priority", priority),))] == 0


def test_registries_are_private_and_independent() -> None:
    first, second = Metrics(), Metrics()
    first.sessions.set(3)
    assert b"hicached_sessions 3.0" in first.render()
    assert b"hicached_sessions 0.0" in second.render()
    assert REGISTRY.get_sample_value("hicached_sessions") is None


def test_every_name_is_prefixed_and_no_label_is_an_id() -> None:
    metrics = Metrics()
    families = list(metrics.registry.collect())
    assert len(families) >= 30
    for family in families:
        assert family.name.startswith("hicached_"), family.name
    for attribute in vars(metrics).values():
        labelnames = getattr(attribute, "_labelnames", ())
        for label in labelnames:
            parts = label.split("_")
            assert not any(p in parts for p in FORBIDDEN_LABEL_PARTS), (label, attribute)


def test_duration_buckets_span_ten_microseconds_to_ten_seconds() -> None:
    assert DURATION_BUCKETS[0] == 1e-5
    assert DURATION_BUCKETS[-1] == 10.0
    assert list(DURATION_BUCKETS) == sorted(DURATION_BUCKETS)


@pytest.mark.parametrize(
    ("check", "value"),
    [
        (Metrics.tier, "l9"),
        (Metrics.direction, "sideways"),
        (Metrics.priority, "urgent"),
        (Metrics.code, "ok"),
    ],
)
def test_value_outside_a_closed_vocabulary_is_rejected(check: object, value: str) -> None:
    assert callable(check)
    with pytest.raises(InvalidArgument, match=repr(value)):
        check(value)


def test_bad_port_is_rejected_and_close_releases_the_port() -> None:
    metrics = Metrics()
    with pytest.raises(InvalidArgument, match="70000"):
        serve_metrics(metrics, "127.0.0.1", 70000)
    endpoint = serve_metrics(metrics, "127.0.0.1", 0)
    port = endpoint.port
    assert port != 0
    assert scrape(port)[("hicached_sessions", ())] == 0
    endpoint.close()
    endpoint.close()  # second close is a no-op
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    # The port is free again: a new endpoint can bind exactly it.
    again = serve_metrics(metrics, "127.0.0.1", port)
    try:
        assert again.port == port
    finally:
        again.close()


def test_metric_names_lists_exposed_sample_names() -> None:
    names = Metrics().metric_names()
    for name in (
        "hicached_write_bytes_total",
        "hicached_rpc_duration_seconds_bucket",
        "hicached_host_used_tokens",
        "hicached_l3_corrupt_pages_total",
        "hicached_prefetch_bandwidth_gbps_bucket",
    ):
        assert name in names
    assert "hicached_write_bytes_bucket" not in names
    assert "hicached_write_bytes" not in names  # a counter's samples all carry a suffix
    metrics = Metrics()
    metrics.write_bytes.labels(model="m", pool="kv").inc()
    metrics.transfer_duration.labels(direction="d2h").observe(1e-3)
    exposed = {s.name for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    assert exposed <= metrics.metric_names()


def test_every_metric_is_in_the_reference_doc_with_its_type_and_labels() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    rows = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`hicached_"):
            rows[cells[0].strip("`")] = (cells[1], cells[2])
    metrics = Metrics()
    families = list(metrics.registry.collect())
    documented = set()
    for family in families:
        name = f"{family.name}_total" if family.type == "counter" else family.name
        assert name in rows, f"{name} is not documented in docs/metrics.md"
        kind, labels = rows[name]
        assert kind == family.type, name
        attribute = next(a for a in vars(metrics).values() if getattr(a, "_name", None) == family.name)
        assert {x.strip() for x in labels.split(",") if x.strip()} == set(attribute._labelnames), name
        documented.add(name)
    assert set(rows) == documented, "docs/metrics.md lists metrics that do not exist"


def test_every_fast_lane_method_label_is_in_the_reference_doc() -> None:
    """Before: the doc named five; the keyed opcodes (GetPages, PutPages, Lookup) were missing."""
    from hicached.server.lane import _OP_NAMES

    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    for name in [*_OP_NAMES.values(), "FastLaneUnknown"]:
        assert f"`{name}`" in doc, name
