"""One registry of L3 backends: name -> (backend class, its config dataclass).

Each backend module calls :func:`register_backend` at import time with its
own frozen config dataclass, so a backend owns its configuration and adding
one is one module plus its member of :class:`L3Backend` and its entry in
``BACKEND_MODULES``. Optional backends
(redis, s3, mooncake) import their client library only when constructed and
raise :class:`~hicached.errors.InvalidArgument` with an install hint when it
is missing.

Backends registered with ``framed=True`` (redis, s3, mooncake) store
:mod:`~hicached.l3.framing` frames and are constructed as ``cls(config,
codec=...)`` when a codec is given (:func:`open_backend`), so the daemon's
``l3.auth_key_file`` reaches them without entering their config dataclass
(which is printed by ``hicached config show``).

Options arrive as a plain mapping (from a config file or the command line);
:func:`build_config` checks every name and type against the dataclass and
names the offending option and what is allowed. Registration happens under a
lock; lookups are read-only and thread-safe.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, cast

from hicached.coerce import coerce, type_hints
from hicached.errors import AlreadyExists, InvalidArgument
from hicached.l3.base import StorageBackend
from hicached.l3.framing import FrameCodec

__all__ = [
    "BACKEND_MODULES",
    "BackendEntry",
    "L3Backend",
    "backend_names",
    "build_config",
    "config_type",
    "create_backend",
    "fix_keys",
    "open_backend",
    "register_backend",
    "takes_frames",
]


class L3Backend(enum.StrEnum):
    """The values of ``l3.backend``: each backend's registered name, and ``none`` (no L3)."""

    FILE = "file"
    REDIS = "redis"
    S3 = "s3"
    MOONCAKE = "mooncake"
    NONE = "none"


# The module that registers each backend when imported, in listing order. A module
# that does not exist yet (a backend still being built) is skipped.
BACKEND_MODULES: dict[L3Backend, str] = {
    L3Backend.FILE: "hicached.l3.file",
    L3Backend.REDIS: "hicached.l3.redis",
    L3Backend.S3: "hicached.l3.s3",
    L3Backend.MOONCAKE: "hicached.l3.mooncake",
}


BackendFactory = Callable[..., StorageBackend]


@dataclasses.dataclass(frozen=True)
class BackendEntry:
    name: str
    factory: BackendFactory
    config_type: type[Any]
    # Stores frames (hicached.l3.framing), so it takes ``codec=`` at construction.
    framed: bool = False
    # The keys an operator fixes when it cannot start ("" = its table, [l3.<name>]).
    fix_keys: str = ""


_ENTRIES: dict[str, BackendEntry] = {}
_LOCK = threading.Lock()
_LOADED = threading.Event()

B = TypeVar("B", bound=type[StorageBackend])


def register_backend(
    name: str, config_type: type[Any], *, framed: bool = False, fix_keys: str = ""
) -> Callable[[B], B]:
    """Class decorator: register ``cls`` (constructed as ``cls(config)``, and with ``framed``
    as ``cls(config, codec=codec)`` too) under ``name``. ``fix_keys``: what the start-up
    error tells an operator to fix when the backend cannot start (default: its table)."""
    if not dataclasses.is_dataclass(config_type):
        raise InvalidArgument(f"config type {config_type!r} of backend {name!r} is not a dataclass")

    def decorate(cls: B) -> B:
        with _LOCK:
            existing = _ENTRIES.get(name)
            factory = cast(BackendFactory, cls)
            if existing is not None and existing.factory is not factory:
                raise AlreadyExists(f"storage backend {name!r} is already registered")
            _ENTRIES[name] = BackendEntry(name, factory, config_type, framed, fix_keys)
        return cls

    return decorate


def _load_builtin() -> None:
    if _LOADED.is_set():
        return
    for module in BACKEND_MODULES.values():
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


def config_type(name: str) -> type[Any]:
    """The config dataclass of backend ``name`` (``InvalidArgument`` for an unknown name)."""
    return _entry(name).config_type


def takes_frames(name: str) -> bool:
    """Whether backend ``name`` stores frames, so authenticates them with a keyed codec."""
    return _entry(name).framed


def fix_keys(name: str) -> str:
    """The keys to fix when backend ``name`` cannot start (its table ``[l3.<name>]`` unless it
    registered more precise ones); never raises, as it is called while reporting an error."""
    _load_builtin()
    entry = _ENTRIES.get(name)
    return (entry.fix_keys if entry is not None else "") or f"[l3.{name}]"


def build_config(name: str, options: Mapping[str, object], *, text: bool = False) -> Any:
    """The backend's config dataclass built from ``options`` (checked, nothing defaulted silently
    except the dataclass's own documented defaults).

    Values are checked by the daemon's one coercer (:func:`hicached.coerce.coerce`): typed
    values must have the field's type; with ``text`` (values from an environment or a
    command line) strings are parsed.
    """
    entry = _entry(name)
    hints = type_hints(entry.config_type)
    fields = {f.name: f for f in dataclasses.fields(entry.config_type)}
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise InvalidArgument(
            f"unknown option(s) {', '.join(map(repr, unknown))} for storage backend {name!r}; "
            f"allowed: {', '.join(fields)}"
        )
    kwargs = {
        key: coerce(
            value,
            hints[key],
            label=f"option {key!r} of storage backend {name!r}",
            metadata=fields[key].metadata,
            text=text,
        )
        for key, value in options.items()
    }
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
    return open_backend(name, build_config(name, options))


def open_backend(name: str, config: Any, *, codec: FrameCodec | None = None) -> StorageBackend:
    """A new backend named ``name`` from its built config dataclass; the caller owns it (``close()``).

    ``codec``: how a framed backend writes and verifies its frames (None: its default, plain
    frames); InvalidArgument for a backend that stores no frames."""
    entry = _entry(name)
    if not isinstance(config, entry.config_type):
        raise InvalidArgument(
            f"storage backend {name!r} takes a {entry.config_type.__name__}, got {type(config).__name__}"
        )
    if codec is None:
        return entry.factory(config)
    if not entry.framed:
        raise InvalidArgument(f"storage backend {name!r} stores no frames; it takes no frame codec")
    return entry.factory(config, codec=codec)
