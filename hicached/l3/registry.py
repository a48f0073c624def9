"""One registry of L3 backends: name -> (backend class, its config dataclass).

Each backend module calls :func:`register_backend` at import time with its
own frozen config dataclass, so a backend owns its configuration and adding
one is one module plus one entry in ``BACKEND_MODULES``. Optional backends
(redis, s3, mooncake) import their client library only when constructed and
raise :class:`~hicached.errors.InvalidArgument` with an install hint when it
is missing.

Options arrive as a plain mapping (from a config file or the command line);
:func:`build_config` checks every name and type against the dataclass and
names the offending option and what is allowed. Registration happens under a
lock; lookups are read-only and thread-safe.
"""

from __future__ import annotations

import dataclasses
import importlib
import threading
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

from hicached.errors import AlreadyExists, InvalidArgument
from hicached.l3.base import StorageBackend

__all__ = [
    "BACKEND_MODULES",
    "BackendEntry",
    "backend_names",
    "build_config",
    "create_backend",
    "register_backend",
]

# Modules that register a backend when imported, in listing order. A module
# that does not exist yet (a backend still being built) is skipped.
BACKEND_MODULES = (
    "hicached.l3.file",
    "hicached.l3.redis",
    "hicached.l3.s3",
    "hicached.l3.mooncake",
)


BackendFactory = Callable[[Any], StorageBackend]


@dataclasses.dataclass(frozen=True)
class BackendEntry:
    name: str
    factory: BackendFactory
    config_type: type[Any]


_ENTRIES: dict[str, BackendEntry] = {}
_LOCK = threading.Lock()
_LOADED = threading.Event()

B = TypeVar("B", bound=type[StorageBackend])


def register_backend(name: str, config_type: type[Any]) -> Callable[[B], B]:
    """Class decorator: register ``cls`` (constructed as ``cls(config)``) under ``name``."""
    if not dataclasses.is_dataclass(config_type):
        raise InvalidArgument(f"config type {config_type!r} of backend {name!r} is not a dataclass")

    def decorate(cls: B) -> B:
        with _LOCK:
            existing = _ENTRIES.get(name)
            factory = cast(BackendFactory, cls)
            if existing is not None and existing.factory is not factory:
                raise AlreadyExists(f"storage backend {name!r} is already registered")
            _ENTRIES[name] = BackendEntry(name, factory, config_type)
        return cls

    return decorate


def _load_builtin() -> None:
    if _LOADED.is_set():
        return
    for module in BACKEND_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
    _LOADED.set()


def backend_names() -> list[str]:
    _load_builtin()
    return sorted(_ENTRIES)


def _entry(name: str) -> BackendEntry:
    _load_builtin()
    entry = _ENTRIES.get(name)
    if entry is None:
        raise InvalidArgument(
            f"unknown storage backend {name!r}; available: {', '.join(sorted(_ENTRIES)) or 'none'}"
        )
    return entry


def _type_name(tp: object) -> str:
    return getattr(tp, "__name__", None) or str(tp)


def _coerce(backend: str, option: str, value: object, tp: object) -> object:
    """``value`` checked against the annotation ``tp`` (ints are accepted for floats)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        members = typing.get_args(tp)
        if value is None and type(None) in members:
            return None
        errors = []
        for member in members:
            if member is type(None):
                continue
            try:
                return _coerce(backend, option, value, member)
            except InvalidArgument as exc:
                errors.append(str(exc))
        raise InvalidArgument(
            f"option {option!r} of storage backend {backend!r} must be "
            f"{' or '.join(_type_name(m) for m in members)}, got {value!r}"
        )
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok:
            value = float(cast(float, value))
    elif isinstance(tp, type):
        ok = isinstance(value, tp)
    else:  # pragma: no cover - configs only use plain types
        raise InvalidArgument(f"option {option!r} of {backend!r} has unsupported type {tp!r}")
    if not ok:
        raise InvalidArgument(
            f"option {option!r} of storage backend {backend!r} must be {_type_name(tp)}, got {value!r}"
        )
    return value


def build_config(name: str, options: Mapping[str, object]) -> Any:
    """The backend's config dataclass built from ``options`` (checked, nothing defaulted silently
    except the dataclass's own documented defaults)."""
    entry = _entry(name)
    hints = typing.get_type_hints(entry.config_type)
    fields = {f.name: f for f in dataclasses.fields(entry.config_type)}
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise InvalidArgument(
            f"unknown option(s) {', '.join(map(repr, unknown))} for storage backend {name!r}; "
            f"allowed: {', '.join(fields)}"
        )
    kwargs = {key: _coerce(name, key, value, hints[key]) for key, value in options.items()}
    missing = [
        f.name
        for f in fields.values()
        if f.name not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise InvalidArgument(f"storage backend {name!r} needs option(s) {', '.join(missing)}")
    return entry.config_type(**kwargs)


def create_backend(name: str, options: Mapping[str, object]) -> StorageBackend:
    """A new backend named ``name`` configured by ``options``; the caller owns it (``close()``)."""
    config = build_config(name, options)
    return _entry(name).factory(config)
