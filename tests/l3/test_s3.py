"""The ``s3`` backend against a real SeaweedFS S3 gateway: layout, verification,
sharing between daemons, configuration and failures.

Fixtures: ``test_s3_fixtures.py``.
"""

from __future__ import annotations

import os
import signal
import sys
import uuid
from typing import Any

import boto3
import pytest
import torch

from hicached.errors import InvalidArgument, Unavailable
from hicached.index import ContentIndex
from hicached.l2 import HostLayout, HostPoolGroup, KVSpec, PoolEntry, PoolKind, create_host_pool
from hicached.l3 import StorageBackend, create_backend
from hicached.l3.framing import FRAME_MAGIC, frame
from hicached.l3.s3 import S3Backend, escape_key, unescape_key
from hicached.testing.procs import free_ports
from hicached.testing.servers import SeaweedFS, seaweedfs

from .test_s3_fixtures import s3_options


@pytest.fixture
def raw(seaweed_srv: SeaweedFS) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=seaweed_srv.endpoint_url,
        aws_access_key_id=seaweed_srv.access_key_id,
        aws_secret_access_key=seaweed_srv.secret_access_key,
        region_name="us-east-1",
    )


def _s3(backend: StorageBackend) -> S3Backend:
    assert isinstance(backend, S3Backend)
    return backend


def test_escape_key_is_flat_prefix_preserving_and_reversible() -> None:
    keys = ["model/tp0/ab12", "..", ".", "a b%c", "t1*", "ü/€", "-_AZaz09"]
    for key in keys:
        name = escape_key(key)
        assert "/" not in name and "." not in name
        assert unescape_key(name) == key
        for cut in range(len(key) + 1):
            assert name.startswith(escape_key(key[:cut]))
    assert escape_key("-_AZaz09") == "-_AZaz09"
    assert escape_key("a/b") == "a%2Fb"


def test_object_layout_is_one_frame_per_page(s3_backend: StorageBackend, raw: Any) -> None:
    backend = _s3(s3_backend)
    assert backend.set(["model/tp0/page 1"], [b"p" * 1000]) == [True]
    name = backend.config.prefix + "model%2Ftp0%2Fpage%201"
    body = raw.get_object(Bucket=backend.config.bucket, Key=name)["Body"].read()
    assert body[:4] == FRAME_MAGIC
    assert body == frame("model/tp0/page 1", [b"p" * 1000])
    listed = raw.list_objects_v2(Bucket=backend.config.bucket, Prefix=backend.config.prefix)
    assert [o["Key"] for o in listed["Contents"]] == [name]


def test_corrupt_objects_are_misses_counted_and_removed(s3_backend: StorageBackend, raw: Any) -> None:
    backend = _s3(s3_backend)
    bucket, prefix = backend.config.bucket, backend.config.prefix
    assert all(backend.set(["c/a", "c/b", "c/c"], [b"a" * 1000, b"b" * 1000, b"c" * 1000]))
    good = raw.get_object(Bucket=bucket, Key=prefix + escape_key("c/a"))["Body"].read()
    flipped = bytearray(good)
    flipped[-1] ^= 0xFF
    raw.put_object(Bucket=bucket, Key=prefix + escape_key("c/a"), Body=bytes(flipped))
    raw.put_object(Bucket=bucket, Key=prefix + escape_key("c/b"), Body=good[:20])  # truncated
    raw.put_object(Bucket=bucket, Key=prefix + escape_key("c/c"), Body=good)  # another key's frame
    before = backend.stats()
    assert backend.get(["c/a", "c/b"]) == [None, None]
    assert backend.get_into(["c/c"], [[memoryview(bytearray(1000))]]) == [False]
    after = backend.stats()
    assert after.corrupt_pages - before.corrupt_pages == 3
    assert after.misses - before.misses == 3
    # Removed, so the page can be stored again despite If-None-Match.
    assert backend.exists(["c/a"]) == 0
    assert backend.set(["c/a"], [b"a" * 1000]) == [True]
    assert backend.get(["c/a"]) == [b"a" * 1000]


def test_an_object_larger_than_the_destination_is_a_miss_left_unread(
    s3_backend: StorageBackend, raw: Any
) -> None:
    """Before: the whole object was read (any size: 256 MiB of someone else's for a 4 KiB page),
    then dropped as corrupt."""
    backend = _s3(s3_backend)
    name = backend.config.prefix + escape_key("big/a")
    raw.put_object(Bucket=backend.config.bucket, Key=name, Body=b"\0" * (8 << 20))
    before = backend.stats()
    assert backend.get_into(["big/a"], [[memoryview(bytearray(4096))]]) == [False]
    after = backend.stats()
    assert (after.misses - before.misses, after.corrupt_pages - before.corrupt_pages) == (1, 0)
    assert raw.head_object(Bucket=backend.config.bucket, Key=name)["ContentLength"] == 8 << 20


def test_pages_are_shared_between_backends_and_outlive_them(seaweed_srv: SeaweedFS) -> None:
    options = s3_options(seaweed_srv)
    first = create_backend("s3", options)
    assert first.set(["sh/a", "sh/b"], [b"1" * 64, b"2" * 64]) == [True, True]
    second = create_backend("s3", options)
    try:
        assert second.exists(["sh/a", "sh/b"]) == 2  # no local index to go stale
        first.close()
        assert second.get(["sh/a", "sh/b"]) == [b"1" * 64, b"2" * 64]
        assert second.delete(["sh/a"]) == 1
        third = create_backend("s3", options)
        assert third.get(["sh/a", "sh/b"]) == [None, b"2" * 64]
        assert third.clear() == 1
        third.close()
    finally:
        first.close()
        second.close()


def test_prefixes_isolate_deployments(seaweed_srv: SeaweedFS) -> None:
    a = create_backend("s3", s3_options(seaweed_srv))
    b = create_backend("s3", s3_options(seaweed_srv))
    try:
        assert a.set(["k"], [b"from a"]) == [True]
        assert b.exists(["k"]) == 0
        assert b.set(["k"], [b"from b"]) == [True]
        assert a.clear() == 1
        assert b.get(["k"]) == [b"from b"]
        assert b.stats().pages == 1
    finally:
        b.clear()
        a.close()
        b.close()


def test_without_conditional_put_existing_keys_are_not_rewritten(seaweed_srv: SeaweedFS) -> None:
    backend = create_backend("s3", s3_options(seaweed_srv, conditional_put=False))
    try:
        assert backend.set(["cp"], [b"first"]) == [True]
        assert backend.set(["cp", "cp2"], [b"second", b"other"]) == [True, True]
        assert backend.get(["cp", "cp2"]) == [b"first", b"other"]
    finally:
        backend.clear()
        backend.close()


def test_stats_list_payload_bytes_and_cache_for_ttl(seaweed_srv: SeaweedFS) -> None:
    backend = create_backend("s3", s3_options(seaweed_srv, stats_ttl_s=3600))
    try:
        assert backend.stats().pages == 0
        assert backend.set(["s/a", "s/b"], [b"x" * 100, b"y" * 50]) == [True, True]
        assert backend.stats().pages == 0  # the listing is reused within the TTL
    finally:
        backend.clear()
        backend.close()
    fresh = create_backend("s3", s3_options(seaweed_srv))
    try:
        assert fresh.set(["s/a", "s/b"], [b"x" * 100, b"y" * 50]) == [True, True]
        stats = fresh.stats()
        assert (stats.pages, stats.bytes, stats.capacity_bytes) == (2, 150, 0)
    finally:
        fresh.clear()
        fresh.close()


def test_too_long_key_raises_before_any_request(s3_backend: StorageBackend) -> None:
    with pytest.raises(InvalidArgument, match="too long for S3"):
        s3_backend.set(["ok", "/" * 400], [b"a", b"b"])
    assert s3_backend.exists(["ok"]) == 0
    with pytest.raises(InvalidArgument, match="too long for S3"):
        s3_backend.get(["/" * 400])


def test_missing_bucket_is_a_configuration_error_unless_created(seaweed_srv: SeaweedFS, raw: Any) -> None:
    bucket = f"hc-new-{uuid.uuid4().hex[:12]}"
    with pytest.raises(InvalidArgument, match=bucket):
        create_backend("s3", s3_options(seaweed_srv, bucket=bucket))
    backend = create_backend("s3", s3_options(seaweed_srv, bucket=bucket, create_bucket=True))
    try:
        assert backend.set(["nb"], [b"x"]) == [True]
        assert backend.get(["nb"]) == [b"x"]
    finally:
        backend.clear()
        backend.close()
        raw.delete_bucket(Bucket=bucket)


def test_unreachable_endpoint_is_unavailable_at_start() -> None:
    (port,) = free_ports(1)
    options = {
        "bucket": "nowhere",
        "endpoint_url": f"http://127.0.0.1:{port}",
        "access_key_id": "a",
        "secret_access_key": "b",
        "max_attempts": 1,
        "connect_timeout_s": 0.5,
    }
    with pytest.raises(Unavailable, match="nowhere"):
        create_backend("s3", options)


def test_server_gone_turns_requests_into_misses() -> None:
    with seaweedfs() as srv:
        backend = create_backend("s3", s3_options(srv, max_attempts=1, connect_timeout_s=0.5))
        listed = create_backend(
            "s3", s3_options(srv, max_attempts=1, connect_timeout_s=0.5, stats_ttl_s=3600)
        )
        assert backend.set(["gone"], [b"x"]) == [True]
        listed.stats()  # lists now: a listing it may reuse for an hour
    try:
        assert backend.get(["gone"]) == [None]
        assert backend.exists(["gone"]) == 0
        assert backend.set(["gone2"], [b"y"]) == [False]
        # A delete that could not reach the store is an error, not "nothing to delete": a clear
        # must not read as done (it returned 0).
        with pytest.raises(Unavailable, match="could not tell whether 1 of 1 objects exist"):
            backend.delete(["gone"])
        # Fails before (a review of stop 46): stats answered the last listing (or zeros) as if
        # all was well, and `hicached status` showed no outage. The stats refresh fails now,
        # whether its listing was due or not (then a HEAD of the bucket asks).
        for b in (backend, listed):
            with pytest.raises(Unavailable, match="does not answer or refuses"):
                b.stats()
    finally:
        backend.close()
        listed.close()


def test_closed_backend_is_unavailable(seaweed_srv: SeaweedFS) -> None:
    backend = create_backend("s3", s3_options(seaweed_srv))
    backend.close()
    backend.close()  # idempotent
    for call in (
        lambda: backend.get(["x"]),
        lambda: backend.set(["x"], [b"x"]),
        lambda: backend.exists(["x"]),
        backend.clear,
        backend.stats,
    ):
        with pytest.raises(Unavailable, match="closed"):
            call()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"bucket": ""}, "'bucket'"),
        ({"bucket": "b", "endpoint_url": "127.0.0.1:9000"}, "'endpoint_url'.*'127.0.0.1:9000'"),
        ({"bucket": "b", "threads": 0}, "'threads'.*got 0"),
        ({"bucket": "b", "addressing_style": "dns"}, "'addressing_style'.*'dns'"),
        ({"bucket": "b", "access_key_id": "only-id"}, "given together"),
        ({"bucket": "b", "prefix": "/abs/"}, "'prefix'"),
        ({"bucket": "b", "read_timeout_s": 0}, "'read_timeout_s'"),
        ({"bucket": "b", "max_attempts": 0}, "'max_attempts'"),
        ({"bucket": "b", "threads": "8"}, "'threads'.*int"),
        ({"bucket": "b", "region_name": "x"}, "unknown option"),
        # boto3's own refusals, before any request: no traceback at start-up.
        ({"bucket": "b", "endpoint_url": "http://exa mple:8333"}, "Invalid endpoint.*l3.s3.endpoint_url"),
        ({"bucket": "b", "region": "bad region!"}, "'bad region!'.*l3.s3.region"),
    ],
)
def test_bad_config_is_rejected_with_the_offending_value(options: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        create_backend("s3", options)


def test_missing_boto3_gives_an_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry makes `import boto3` raise ImportError, as on a machine without it.
    monkeypatch.setitem(sys.modules, "boto3", None)
    with pytest.raises(InvalidArgument, match=r"pip install 'hicached\[s3\]'"):
        create_backend("s3", {"bucket": "b"})


def test_missing_credentials_are_a_configuration_error(
    seaweed_srv: SeaweedFS, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    # boto3's default chain finds nothing: no AWS_* variables, no ~/.aws files,
    # and no instance-metadata lookup (it would leave loopback).
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    options = {"bucket": seaweed_srv.bucket, "endpoint_url": seaweed_srv.endpoint_url, "max_attempts": 1}
    with pytest.raises(InvalidArgument, match=f"credentials for bucket '{seaweed_srv.bucket}'"):
        create_backend("s3", options)


def test_a_key_whose_object_name_is_too_long_is_refused_before_it_is_stored(seaweed_srv: SeaweedFS) -> None:
    """Escaping can make an object name three times its key: 400 dots are 1,200 bytes, over S3's
    1,024. Before, the index let such a key in (S3 declared no limit), and its batch failed later
    in the backup thread, every key of it."""
    backend = create_backend("s3", s3_options(seaweed_srv))
    spec = KVSpec(PoolKind.MHA, torch.float16, 1, 1, 4, 4)
    pool = create_host_pool(
        spec, HostLayout.PAGE_FIRST, 8, segment_name=f"hc-s3key-{uuid.uuid4().hex[:8]}", pin=False
    )
    try:
        group = HostPoolGroup([PoolEntry("kv", pool, is_primary_index_anchor=True)])
        with ContentIndex(group, namespace="ns", backend=backend) as index:
            with pytest.raises(InvalidArgument, match=r"its L3 name 1[0-9]{3} bytes"):
                index.check_storable(["." * 400])
            index.check_storable(["k" * 400])  # as long, nothing to escape: it fits
    finally:
        backend.close()
        pool.close()
        pool.unlink()


def test_a_stalled_store_costs_one_timeout_per_call_not_one_per_key(seaweed_srv: SeaweedFS) -> None:
    """The gateway stops answering (SIGSTOP: TCP still accepted, no reply). Before, each of a
    call's 32 requests waited out its own timeout, 4 at a time; now the requests not yet sent
    when the first one times out fail without being sent, and the store is tried again by the
    next call."""
    backend = create_backend("s3", s3_options(seaweed_srv, max_attempts=1, read_timeout_s=0.5))
    sent: list[str] = []
    _s3(backend)._client.meta.events.register(
        "before-send.s3.*", lambda **kw: sent.append(kw["request"].method)
    )
    keys = [f"stall-{i}" for i in range(32)]
    try:
        assert backend.set(keys[:1], [b"kept"]) == [True]
        sent.clear()
        os.killpg(os.getpgid(seaweed_srv.pid), signal.SIGSTOP)
        try:
            assert backend.set(keys, [b"x"] * len(keys)) == [False] * len(keys)
            assert 1 <= len(sent) <= 4  # at most one round of the 4 threads reached the store
            sent.clear()
            assert backend.get(keys) == [None] * len(keys)
            assert 1 <= len(sent) <= 4
            sent.clear()
            with pytest.raises(Unavailable, match="could not tell whether"):
                backend.delete(keys)
            assert 1 <= len(sent) <= 4
        finally:
            os.killpg(os.getpgid(seaweed_srv.pid), signal.SIGCONT)
        assert backend.get(keys[:1]) == [b"kept"]  # the next call reaches the store again
        assert backend.set(keys[1:2], [b"y"]) == [True]
    finally:
        backend.close()
