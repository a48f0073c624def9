"""The backend registry: names, option checking, config ownership."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicached.config import Config
from hicached.errors import InvalidArgument
from hicached.l3 import backend_names, create_backend
from hicached.l3.file import FileBackend, FileBackendConfig
from hicached.l3.redis import RedisBackendConfig
from hicached.l3.registry import BACKEND_MODULES, L3Backend, build_config, fix_keys


def test_builtin_backends_registered() -> None:
    names = backend_names()
    assert {"file", "redis"} <= set(names)


def test_unknown_backend_lists_available() -> None:
    with pytest.raises(InvalidArgument, match=r"unknown storage backend 'nfs'; available: .*file.*redis"):
        create_backend("nfs", {})


def test_unknown_option_lists_allowed(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match=r"'capacity'.*allowed: path, capacity_bytes, max_pages, fsync"):
        create_backend("file", {"path": str(tmp_path), "capacity": 1})
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "needs option"),
        ({"path": 3}, "'path' of storage backend 'file' = 3: expected a string"),
        ({"path": "x", "capacity_bytes": True}, "= True: expected a whole number of bytes"),
        ({"path": "x", "capacity_bytes": 1.5}, "= 1.5: expected a whole number of bytes"),
        ({"path": "x", "fsync": "yes"}, "= 'yes': expected true or false"),
        ({"path": ""}, "non-empty"),
    ],
)
def test_ill_typed_options(options: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        create_backend("file", options)


def test_configs_are_owned_and_typed(tmp_path: Path) -> None:
    config = build_config("file", {"path": str(tmp_path), "capacity_bytes": 1 << 20})
    assert config == FileBackendConfig(path=str(tmp_path), capacity_bytes=1 << 20)
    redis_config = build_config("redis", {"password": None, "socket_timeout_s": 2})
    assert isinstance(redis_config, RedisBackendConfig)
    assert redis_config.socket_timeout_s == 2.0 and redis_config.password is None
    with pytest.raises(InvalidArgument, match=r"'password'.*expected a string"):
        build_config("redis", {"password": 5})
    backend = create_backend("file", {"path": str(tmp_path / "d")})
    try:
        assert isinstance(backend, FileBackend)
        assert backend.stats().capacity_bytes == FileBackendConfig.capacity_bytes
    finally:
        backend.close()


def test_every_backend_value_but_none_is_a_registered_backend() -> None:
    """``l3.backend``'s vocabulary (:class:`L3Backend`) is the registry's names, and ``none``."""
    assert set(backend_names()) == {b.value for b in L3Backend} - {L3Backend.NONE.value}
    assert set(BACKEND_MODULES) == set(L3Backend) - {L3Backend.NONE}


def test_every_backend_says_where_its_pages_are_and_what_to_fix() -> None:
    """The start-up line and error take both from the backend (no list of backends beside the registry)."""
    defaults = Config().l3
    for name in backend_names():
        assert getattr(defaults, name).target(), name
        assert fix_keys(name).startswith(f"l3.{name}."), name
    assert fix_keys("nfs") == "[l3.nfs]"
