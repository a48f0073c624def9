"""Adapter options: defaults, validation errors naming the bad value, nothing left behind."""

from __future__ import annotations

from typing import Any

import pytest
from hicached_client.sglang import AdapterConfig, Transport
from hicached_client.sglang.namespace import escape_key, key_space
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from tests.sglang.pools import PoolShape, StorageFactory, make_host_pool, unique_model


def test_defaults_and_unique_instance_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HICACHED_SOCKET", "/tmp/somewhere.sock")
    a = AdapterConfig.from_extra_config({"backend_name": "hicached"})
    b = AdapterConfig.from_extra_config(None)
    assert a.target == "unix:///tmp/somewhere.sock"
    assert (a.transport, a.staging_pages, a.include_l3, a.tenant) == (Transport.SHM, 128, True, "")
    assert a.instance_id and a.instance_id != b.instance_id


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tenat": "x"}, r"unknown hicached option\(s\) \['tenat'\]"),
        ({"transport": "rdma"}, "transport must be one of .*'rdma'"),
        ({"staging_pages": 0}, "staging_pages must be an integer >= 1, got 0"),
        ({"staging_pages": True}, "staging_pages must be an integer >= 1, got True"),
        ({"host_bytes": -1}, "host_bytes must be an integer >= 0, got -1"),
        ({"timeout_s": 0}, "timeout_s must be a positive number, got 0"),
        ({"include_l3": "yes"}, "include_l3 must be true or false, got 'yes'"),
        ({"fast_lane": 1}, "fast_lane must be true or false, got 1"),
        ({"target": ""}, "target must be a non-empty string"),
    ],
)
def test_bad_options_are_errors(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AdapterConfig.from_extra_config({"hicached": options})


def test_options_must_be_an_object() -> None:
    with pytest.raises(ValueError, match="must be a JSON object"):
        AdapterConfig.from_extra_config({"hicached": "unix:///x"})


def test_bad_config_through_the_factory_leaves_nothing(storages: StorageFactory) -> None:
    cfg = storages.config(model=unique_model(), staging_pages=-3)
    with pytest.raises(ValueError, match="staging_pages"):
        StorageBackendFactory.create_backend("dynamic", cfg, make_host_pool(PoolShape()))


def test_unreachable_daemon_fails_the_attach_and_frees_the_staging_area() -> None:
    factory = StorageFactory("unix:///tmp/hicached-no-such-daemon.sock")
    pool = make_host_pool(PoolShape())
    with pytest.raises(Exception, match="UNAVAILABLE"):
        factory.make(pool, model=unique_model(), timeout_s=0.5)
    factory.close_all()  # the no_leaked_staging fixture checks /dev/shm


def test_key_spaces_separate_pools_ranks_and_tenants() -> None:
    base = {"tenant": "", "tp_rank": 0, "tp_size": 2, "tp_sharded_in_key": False}
    assert key_space("kv", **base).daemon_key("abc") == "abc"
    assert key_space("swa", **base).daemon_key("abc") == "abc.swa"
    assert key_space("mamba", **{**base, "tp_sharded_in_key": True}).daemon_key("k") == "k.mamba#tp0_2"
    assert key_space("kv", **{**base, "tenant": "t/1"}).daemon_key("k") == "k@t%2F1"
    assert key_space("kv", **base, attn_cp_rank=1, attn_cp_size=2).suffix == "#cp1_2"
    assert escape_key("a/b") != escape_key("a%2Fb")
    # HiCacheFile takes an empty key: it maps to what no other key's rewrite can be.
    assert escape_key("") == "%" and escape_key("%") == "%25"
    space = key_space("swa", **{**base, "tenant": "t"})
    keys = ["0f3a", "a/b", "a%2Fb", "%", "é/ü", "a~b"]
    assert space.daemon_keys(keys) == [space.daemon_key(k) for k in keys] == [
        "0f3a.swa@t", "a%2Fb.swa@t", "a%252Fb.swa@t", "%25.swa@t", "é%2Fü.swa@t", "a%7Eb.swa@t"
    ]  # fmt: skip
    assert space.daemon_keys(["0f3a", "a~b"])[1] == "a%7Eb.swa@t"  # the batch's fast test too
    assert space.daemon_keys(["ok", ""]) == ["ok.swa@t", "%.swa@t"]
    for bad in (None, b"ab", 7):
        with pytest.raises(ValueError, match="must be a string"):
            space.daemon_keys(["ok", bad])  # type: ignore[list-item]


def test_a_batch_of_plain_keys_maps_as_each_key_alone() -> None:
    """daemon_keys tests a batch with nothing to escape on its joined text: the same keys,
    each a plain str, as daemon_key one at a time (SGLang's hex digests take this path)."""

    class Key(str):
        pass

    base = {"tp_rank": 0, "tp_size": 1, "tp_sharded_in_key": False}
    plain = [f"{i:064x}" for i in range(128)] + ["é中", Key("sub")]
    for space in (key_space("kv", tenant="", **base), key_space("swa", tenant="t", **base)):
        got = space.daemon_keys(plain)
        assert got == [space.daemon_key(k) for k in plain]
        assert all(type(k) is str for k in got)
        # One key to escape anywhere in the batch: every key still maps as it alone would.
        for i in (0, 64, len(plain) - 1):
            mixed = [*plain[:i], "a/b%", *plain[i + 1 :]]
            assert space.daemon_keys(mixed) == [space.daemon_key(k) for k in mixed]
