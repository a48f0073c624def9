"""A configuration built in Python goes through the same coercer as a file's values.

Before, ``L3Config(backend="none")`` kept the string and failed later, at start, with an
AttributeError (``.value`` of a str); ``SessionConfig(tenant_uids="a=1")`` kept the text where
the attach check looks tenants up in a mapping; ``HostConfig(budget="4GiB")`` kept the string.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from hicached.config import Config, ConfigError, resolve
from hicached.config.sections import HostConfig, L3Config, ServerConfig, SessionConfig
from hicached.errors import InvalidArgument
from hicached.index.types import WritePolicy
from hicached.l3.file.options import FileBackendConfig
from hicached.l3.redis import RedisBackendConfig
from hicached.l3.registry import L3Backend


def test_values_a_file_could_give_are_typed_as_a_files_are() -> None:
    l3 = L3Config(backend="none", write_policy="write_back")  # type: ignore[arg-type]
    assert l3.backend is L3Backend.NONE and l3.write_policy is WritePolicy.WRITE_BACK
    assert l3.backend_config() is None
    assert HostConfig(budget="4GiB").budget == 4 << 30  # type: ignore[arg-type]
    assert ServerConfig(grace_s=3).grace_s == 3.0 and isinstance(ServerConfig(grace_s=3).grace_s, float)
    uids = SessionConfig(tenant_uids="team-a=1001,1000").tenant_uids  # type: ignore[arg-type]
    assert uids == {"team-a": frozenset({1000, 1001})}
    assert SessionConfig(tenant_uids={"team-a": [1000, 1000]}).tenant_uids == {"team-a": frozenset({1000})}
    with pytest.raises(TypeError):
        uids["team-b"] = frozenset({1})  # type: ignore[index]
    # Typed values come back equal to what the resolver builds from text.
    built = Config(l3=l3, host=HostConfig(budget="4GiB"))  # type: ignore[arg-type]
    assert built == resolve(
        cli={"l3.backend": "none", "l3.write_policy": "write_back", "host.budget": "4GiB"}, env={}
    )


@pytest.mark.parametrize(
    ("build", "words"),
    [
        (lambda: L3Config(backend="nfs"), ["l3.backend", "'nfs'", "one of file, redis"]),
        (lambda: L3Config(io_workers=2.5), ["l3.io_workers", "2.5", "an integer"]),
        (lambda: L3Config(io_workers="2"), ["l3.io_workers", "'2'", "an integer"]),
        (lambda: ServerConfig(grace_s=float("nan")), ["server.grace_s", "nan"]),
        (lambda: ServerConfig(fast_lane="yes"), ["server.fast_lane", "'yes'", "true or false"]),
        (lambda: HostConfig(budget="lots"), ["host.budget", "'lots'"]),
        (lambda: SessionConfig(tenant_uids={"a=1;b": [2]}), ["sessions.tenant_uids", "tenant"]),
        (
            lambda: SessionConfig(tenant_uids={"a": "1000"}),
            ["sessions.tenant_uids", "collection of integers"],
        ),
        (lambda: SessionConfig(tenant_uids={"a": [True]}), ["sessions.tenant_uids", "non-negative integers"]),
        (lambda: SessionConfig(tenant_uids={"a": [-1]}), ["sessions.tenant_uids", "non-negative integers"]),
        (lambda: SessionConfig(tenant_uids={"a": []}), ["sessions.tenant_uids", "non-negative integers"]),
        (lambda: SessionConfig(tenant_uids={"a": [1 << 32]}), ["sessions.tenant_uids", "(32-bit)"]),
        (
            lambda: SessionConfig(tenant_uids="a=\u0661\u0660\u0660\u0660"),
            ["sessions.tenant_uids", "(32-bit)"],
        ),
        (lambda: Config(l3="file"), ["l3", "'file'", "L3Config"]),
        (lambda: L3Config(backend="x" * 100_000), ["l3.backend", "... (100002 chars)"]),
        (lambda: HostConfig(budget_fraction=10**400), ["host.budget_fraction", "(401 chars)", "a number"]),
    ],
    ids=[
        "enum",
        "float int",
        "text int",
        "nan",
        "text bool",
        "size",
        "tenant name",
        "uids text",
        "uid bool",
        "uid negative",
        "no uids",
        "uid past 32 bits",
        "uid in non-ASCII digits",
        "section",
        "long value",
        "huge int",
    ],
)
def test_a_wrong_value_is_a_config_error_naming_the_key(build: Any, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        build()
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert len(str(info.value)) < 300, "a value is quoted by a short prefix"


def test_a_backends_table_is_checked_by_the_same_coercer(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match=r"l3\.file\.io_threads = '4'"):
        FileBackendConfig(path=str(tmp_path), io_threads="4")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"l3\.redis\.port = 6379\.0"):
        RedisBackendConfig(port=6379.0)  # type: ignore[arg-type]
    table = FileBackendConfig(path=str(tmp_path), capacity_bytes="1GiB")  # type: ignore[arg-type]
    assert table.capacity_bytes == 1 << 30
    assert dataclasses.replace(table, fsync=True).capacity_bytes == 1 << 30
