"""Pure conversions: pool specs, targets, enums, retry policy (no server needed)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable

import grpc
import pytest
import torch
from hicached_client import (
    NO_RETRY,
    ChannelConfig,
    HostLayout,
    PoolKind,
    RetryPolicy,
    TokenChain,
    WorkerIdentity,
    _calls,
    default_target,
    pool_spec,
)
from hicached_client import _convert as cv
from hicached_client._channel import normalize_target
from hicached_client.errors import from_rpc_error
from hicached_client.v1 import types_pb2 as tpb


def _buffer(name: str) -> tpb.DeviceBuffer:
    return tpb.DeviceBuffer(
        handle=tpb.DeviceHandle(shm=tpb.ShmHandle(name=name, size=64)),
        shape=[4, 1, 8],
        dtype=tpb.DATA_TYPE_FLOAT16,
    )


def test_pool_spec_accepts_strings_enums_and_torch_dtypes() -> None:
    spec = pool_spec(
        "kv",
        role="ANCHOR",
        kind=PoolKind.MHA,
        dtype=torch.bfloat16,
        host_layout="page_first",
        page_size=16,
        num_layers=2,
        num_heads=4,
        head_dim=8,
        k_buffers=[_buffer("k0"), _buffer("k1")],
        v_buffers=[_buffer("v0"), _buffer("v1")],
        host_bytes=1 << 20,
        layer_ids=[0, -1],
    )
    assert spec.role == tpb.POOL_ROLE_ANCHOR
    assert spec.kind == tpb.POOL_KIND_MHA
    assert spec.dtype == tpb.DATA_TYPE_BFLOAT16
    assert spec.host_layout == tpb.HOST_LAYOUT_PAGE_FIRST
    assert spec.host_size.WhichOneof("size") == "bytes" and spec.host_size.bytes == 1 << 20
    assert list(spec.layer_ids) == [0, -1]
    assert [b.handle.shm.name for b in spec.k_buffers] == ["k0", "k1"]
    derived = pool_spec(
        "idx",
        role="derived",
        kind="mla",
        dtype="uint8",
        page_size=16,
        num_layers=1,
        num_heads=1,
        head_dim=8,
        k_buffers=[],
        indices_from_pool="kv",
        host_ratio=2.0,
    )
    assert derived.role == tpb.POOL_ROLE_DERIVED and derived.indices_from_pool == "kv"
    assert derived.host_layout == tpb.HOST_LAYOUT_LAYER_FIRST
    assert derived.host_size.ratio == 2.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"role": "leader"}, "unknown PoolRole 'leader'"),
        ({"kind": "gqa"}, "unknown PoolKind 'gqa'"),
        ({"dtype": torch.int32}, "unknown DataType 'int32'"),
        ({"host_layout": "row"}, "unknown HostLayout 'row'"),
        ({"host_ratio": 2.0, "host_bytes": 10}, "not both"),
    ],
)
def test_pool_spec_rejects_bad_values_naming_them(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {
        "role": "anchor",
        "kind": "mha",
        "dtype": "float16",
        "page_size": 1,
        "num_layers": 1,
        "num_heads": 1,
        "head_dim": 1,
        "k_buffers": [],
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        pool_spec("kv", **args)  # type: ignore[arg-type]


def test_enum_tables_cover_every_wire_value() -> None:
    assert set(cv.HOST_LAYOUTS) == set(HostLayout)
    wire = {v for k, v in tpb.HostLayout.items() if not k.endswith("UNSPECIFIED")}
    assert set(cv.HOST_LAYOUTS.values()) == wire
    assert set(cv.DATA_TYPES.values()) == {
        v for k, v in tpb.DataType.items() if not k.endswith("UNSPECIFIED")
    }
    assert cv.enum_from_wire(cv.HOST_LAYOUTS, tpb.HOST_LAYOUT_UNSPECIFIED) is None


def test_token_chain_keys_keep_optional_fields_absent() -> None:
    wire = cv.keys_to_wire(TokenChain([1, 2, 3], cache_salt="salt"), tenant="t")
    assert list(wire.tokens.token_ids) == [1, 2, 3]
    assert wire.tokens.HasField("cache_salt") and not wire.tokens.HasField("extra_key")
    assert wire.tenant == "t"
    assert list(cv.keys_to_wire(["aa", "bb"]).keys.keys) == ["aa", "bb"]


def test_default_target(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HICACHED_SOCKET", "/x/y.sock")
    assert default_target() == "unix:///x/y.sock"
    monkeypatch.setenv("HICACHED_SOCKET", "localhost:7000")
    assert default_target() == "localhost:7000"
    monkeypatch.delenv("HICACHED_SOCKET")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/5")
    assert default_target() == "unix:///run/user/5/hicached/hicached.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    expected = "/run/hicached" if os.geteuid() == 0 else f"/tmp/hicached-{os.geteuid()}"
    assert default_target() == f"unix://{expected}/hicached.sock"


def test_relative_socket_paths_are_paths_and_host_names_stay_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Relative paths (``serve --socket run/d.sock`` binds one from its working directory) were
    taken for host:port; a bare host name (gRPC's default port) must stay a host name."""
    here = os.getcwd()
    for given, path in (("run/d.sock", "run/d.sock"), ("d.sock", "d.sock"), ("./d", "d")):
        assert normalize_target(given) == f"unix://{here}/{path}"
    assert normalize_target("~/d.sock") == f"unix://{os.path.expanduser('~')}/d.sock"
    for target in ("localhost", "cache.example.com", "h:1", "[::1]:80", "dns:///h:1", "unix:rel"):
        assert normalize_target(target) == target
    monkeypatch.setenv("HICACHED_SOCKET", "mysock")  # a socket's variable: a path, whatever its name
    assert default_target() == f"unix://{here}/mysock"


def test_channel_config_validation() -> None:
    with pytest.raises(ValueError, match="TCP targets"):
        ChannelConfig(target="/a.sock", credentials=grpc.ssl_channel_credentials())
    with pytest.raises(ValueError, match="empty hicached target"):
        ChannelConfig(target="")
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)
    assert ChannelConfig(target="h:1", token="t").metadata() == (("authorization", "Bearer t"),)


def test_retry_policy_is_the_channels_service_config() -> None:
    """Retries are gRPC's (issue 14): the policy becomes a retryPolicy for every RPC but Attach
    and the two streams (the client retries those: see the test below)."""
    policy = RetryPolicy(max_attempts=3, initial_backoff_s=0.1, max_backoff_s=0.15)
    every, plain = policy.service_config()["methodConfig"]
    assert every["retryPolicy"] == {
        "maxAttempts": 3,
        "initialBackoff": "0.1s",
        "maxBackoff": "0.15s",
        "backoffMultiplier": 2.0,
        "retryableStatusCodes": ["DEADLINE_EXCEEDED", "UNAVAILABLE"],
    }
    assert {n["service"] for n in every["name"]} == {"hicached.v1.HiCacheService", "hicached.v1.AdminService"}
    names = ("Attach", "Load", "RetractRestore")
    assert plain == {"name": [{"service": "hicached.v1.HiCacheService", "method": m} for m in names]}
    opted = RetryPolicy(retry_resource_exhausted=True).service_config()["methodConfig"][0]
    assert "RESOURCE_EXHAUSTED" in opted["retryPolicy"]["retryableStatusCodes"]
    assert all("retryPolicy" not in m for m in NO_RETRY.service_config()["methodConfig"])
    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
    assert RetryPolicy(retry_resource_exhausted=True).retries(exhausted) and not policy.retries(exhausted)
    assert policy.retries(grpc.StatusCode.UNAVAILABLE) and not NO_RETRY.retries(grpc.StatusCode.UNAVAILABLE)
    options = dict(ChannelConfig(target="h:1", retry=policy).channel_options())
    assert json.loads(options["grpc.service_config"]) == policy.service_config()
    assert options["grpc.enable_retries"] == 1
    with pytest.raises(ValueError, match="gRPC's limit"):
        RetryPolicy(max_attempts=6)
    with pytest.raises(ValueError, match=r">= 0\.01 s"):
        RetryPolicy(initial_backoff_s=0.001)


def test_a_stream_is_retried_as_the_policy_says_within_its_deadline() -> None:
    """RetryPolicy.stream_retry_s: gRPC's rules for a retried call, applied by the client."""
    policy = RetryPolicy(max_attempts=3, initial_backoff_s=0.1, max_backoff_s=0.15)
    unavailable, exhausted = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED
    first = policy.stream_retry_s(1, unavailable, None, None)
    assert first is not None and 0 <= first <= 0.1  # jittered, at most the initial backoff
    second = policy.stream_retry_s(2, unavailable, None, None)
    assert second is not None and 0 <= second <= 0.15  # capped at max_backoff_s
    assert policy.stream_retry_s(3, unavailable, None, None) is None  # attempts spent
    assert policy.stream_retry_s(1, exhausted, None, None) is None  # not a retried code
    assert policy.stream_retry_s(1, unavailable, 250, None) == 0.25  # the server's pushback first
    assert policy.stream_retry_s(1, unavailable, -1, None) is None  # pushback: do not retry
    assert policy.stream_retry_s(1, unavailable, 250, 0.2) is None  # it would start past the deadline
    assert NO_RETRY.stream_retry_s(1, unavailable, None, None) is None


class _FakeCall(grpc.RpcError):
    """Stands in for a grpc call object only to feed malformed metadata to the converter."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.RESOURCE_EXHAUSTED

    def details(self) -> str:
        return "busy"

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("other", "1"), ("grpc-retry-pushback-ms", "soon"))


def test_malformed_retry_hint_does_not_hide_the_error() -> None:
    err = from_rpc_error(_FakeCall(), "Alloc")
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.message == "busy"
    assert err.retry_after_ms is None and err.method == "Alloc"


class _LegacyCall(_FakeCall):
    """A daemon from before the pushback change sent its hint under a private key."""

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("retry-after-ms", "75"),)


def test_the_hint_of_an_older_daemon_is_still_read() -> None:
    assert from_rpc_error(_LegacyCall(), "Alloc").retry_after_ms == 75


@pytest.mark.parametrize(
    ("build", "named"),
    [
        (lambda: _calls.alloc("s", "o", "kv", -1), "num_pages = -1"),
        (lambda: _calls.alloc("s", "o", "kv", 1.5), "num_pages = 1.5"),
        (lambda: _calls.attach("o", WorkerIdentity("w", -1, "m"), [], 0), "generation = -1"),
        (lambda: _calls.attach("o", WorkerIdentity("w", 1, "m", tp_rank=-2), [], 0), "tp_rank = -2"),
        (lambda: _calls.attach("o", WorkerIdentity("w", 1, "m"), [], -5), "lease_ms = -5"),
    ],
)
def test_a_value_protobuf_refuses_is_named_before_anything_is_sent(
    build: Callable[[], object], named: str
) -> None:
    """Fails before (a review of stop 47): protobuf's own words ("Value out of range: -1")
    named no argument, where the client's checks promise to name it."""
    with pytest.raises((TypeError, ValueError), match=re.escape(named)):
        build()


def test_a_string_protobuf_cannot_encode_keeps_its_own_error() -> None:
    """Fails before (a review of this stop's change): re-raising a UnicodeEncodeError with a
    message of its own raised TypeError ("takes exactly 5 arguments") instead."""
    with pytest.raises(UnicodeEncodeError):
        _calls.alloc("s", "o", "\ud800", 1)
