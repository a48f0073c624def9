"""What workers' names do to /metrics: ``model`` and ``pool`` label values are the clients'
strings. Long ones are cut to 64 characters with a hash (before, 64 models x 32 pools of
256- and 100-byte names made every scrape 3.3 MB, 180x), and pool groups of one model and
pool name in other layouts are summed (before, they shared one gauge series and the last
group refreshed overwrote the others). A real daemon with metrics on 127.0.0.1:0.
"""

from __future__ import annotations

import urllib.request

from hicached_client import HiCacheClient, Session, WorkerIdentity, pool_spec
from prometheus_client.parser import text_string_to_metric_families

from hicached.metrics import MAX_LABEL_CHARS
from tests.support.daemon import Daemon
from tests.support.state import poll

Series = dict[tuple[str, str], float]


def _attach(client: HiCacheClient, model: str, pool: str, head_dim: int, pages: int) -> Session:
    """A byte-only session of ``pages`` one-token pages (K and V of bf16: 4 x head_dim bytes)."""
    spec = pool_spec(
        pool, role="anchor", kind="mha", dtype="bfloat16", page_size=1, num_layers=1, num_heads=1,
        head_dim=head_dim, host_layout="layer_first", k_buffers=(), v_buffers=(), host_bytes=pages * 4 * head_dim,
    )  # fmt: skip
    return client.attach(
        WorkerIdentity(f"w-{len(model)}-{head_dim}-{model[-4:]}", 1, model), [spec], heartbeat=True
    )


def _host_total_tokens(port: int) -> Series:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.labels["model"], s.labels["pool"]): s.value
        for family in text_string_to_metric_families(text)
        if family.name == "hicached_host_total_tokens"
        for s in family.samples
    }


def _tokens(session: Session) -> int:
    return sum(p.total_pages * p.page_size for p in session.stats().pools())


def test_long_model_and_pool_names_become_short_distinct_label_values(
    metrics_served: tuple[Daemon, int],
) -> None:
    daemon, port = metrics_served
    stem, pool = "m" * 250, "p" * 100
    with HiCacheClient(daemon.target, timeout_s=30) as client:
        first = _attach(client, stem + "-first", pool, 8, 16)
        second = _attach(client, stem + "-other", pool, 8, 32)
        expected = sorted([_tokens(first), _tokens(second)])
        try:
            series = poll(
                lambda: {k: v for k, v in _host_total_tokens(port).items() if k[0].startswith("mmmm")},
                lambda got: len(got) == 2 and all(len(m) <= MAX_LABEL_CHARS for m, _ in got),
                10.0,
                "two series with bounded label values",
            )
        finally:
            first.detach()
            second.detach()
    assert sorted(series.values()) == expected
    for model, pool_label in series:
        assert len(model) <= MAX_LABEL_CHARS and len(pool_label) <= MAX_LABEL_CHARS
        assert model.startswith("m" * 40) and pool_label.startswith("p" * 40)  # still recognisable


def test_groups_of_one_model_and_pool_name_are_summed(metrics_served: tuple[Daemon, int]) -> None:
    """Two layouts of model ``llama-collide`` (head_dim 8 and 16): two pool groups, one series."""
    daemon, port = metrics_served
    with HiCacheClient(daemon.target, timeout_s=30) as client:
        narrow = _attach(client, "llama-collide", "kv", 8, 64)
        wide = _attach(client, "llama-collide", "kv", 16, 8)
        try:
            assert narrow.stats().groups[0].group != wide.stats().groups[0].group
            both = _tokens(narrow) + _tokens(wide)
            poll(
                lambda: _host_total_tokens(port).get(("llama-collide", "kv")),
                lambda value: value == both,
                10.0,
                f"hicached_host_total_tokens of both groups ({both})",
            )
        finally:
            narrow.detach()
            wide.detach()
