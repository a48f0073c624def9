"""The daemon's configuration: frozen dataclasses resolved in one place.

Precedence: CLI flags > environment (``HICACHED_<SECTION>_<KEY>``) > TOML file
(``[section] key = value``) > embedded defaults. ``resolve()`` is the only
function that reads any of those sources; everything else receives a
``Config``. An invalid value stops startup with ``ConfigError`` naming the key,
the value and what is allowed — there is no silent fallback.

Each field's ``metadata["help"]`` documents it; ``hicached config show`` and the
README's configuration reference are generated from the same table
(``describe()``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicached.errors import InvalidArgument


class ConfigError(InvalidArgument):
    """An invalid configuration value (names key, value and what is allowed)."""


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str | int) -> int:
    """``"256MiB"`` / ``"4G"`` / ``1024`` -> bytes (binary units)."""
    if isinstance(text, bool) or not isinstance(text, int | str):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"negative size: {text}")
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (use e.g. 512MiB, 4GiB, 1048576)")
    unit = (m.group(2) or "").upper().rstrip("B").rstrip("I")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def _runtime_dir() -> Path:
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "hicached"
    if os.geteuid() == 0:
        return Path("/run/hicached")
    return Path(f"/tmp/hicached-{os.geteuid()}")


def _cache_dir() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg) / "hicached"
    if os.geteuid() == 0:
        return Path("/var/cache/hicached")
    return Path.home() / ".cache" / "hicached"


def available_memory_bytes() -> int:
    """Memory this process may use: MemAvailable, capped by the cgroup v2/v1 limit."""
    avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            raw = Path(limit_file).read_text().strip()
            if raw == "max":
                continue
            limit = int(raw)
            if limit >= 1 << 60:  # cgroup v1 "unlimited"
                continue
            used = int(Path(usage_file).read_text().strip())
            avail = min(avail, max(limit - used, 0))
        except (OSError, ValueError):
            continue
    return avail


def _f(default: Any, help: str, *, parse: Callable[[Any], Any] | None = None, **kw: Any) -> Any:
    meta: dict[str, Any] = {"help": help}
    if parse is not None:
        meta["parse"] = parse
    if callable(default) and not isinstance(default, type):
        return field(default_factory=default, metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


@dataclass(frozen=True)
class ServerConfig:
    socket: Path = _f(lambda: _runtime_dir() / "hicached.sock", "Unix socket path the daemon listens on.")
    socket_mode: int = _f(0o660, "Permission bits of the socket file (octal in TOML: 0o660).")
    listen: str = _f("", "Also listen on TCP HOST:PORT (empty = Unix socket only).")
    auth_token_file: str = _f("", "File holding the bearer token required on TCP (empty = none).")
    tls_cert: str = _f("", "PEM certificate for TCP (with tls_key enables TLS).")
    tls_key: str = _f("", "PEM private key for TCP.")
    tls_client_ca: str = _f("", "PEM CA bundle; when set, TCP clients must present a certificate (mTLS).")
    max_batch_pages: int = _f(1 << 16, "Largest number of pages one request may carry.")
    max_message_bytes: int = _f(64 << 20, "Largest gRPC message (bytes).", parse=parse_size)
    metrics_host: str = _f("127.0.0.1", "Address of the Prometheus /metrics HTTP server.")
    metrics_port: int = _f(-1, "Port of /metrics (-1 = disabled, 0 = any free port).")
    grace_s: float = _f(10.0, "Seconds in-flight RPCs get to finish on SIGTERM.")


@dataclass(frozen=True)
class HostConfig:
    budget: int = _f(0, "Node-wide host (L2) memory budget in bytes; 0 = budget_fraction.", parse=parse_size)
    budget_fraction: float = _f(
        0.25, "Budget as a fraction of available memory (cgroup-aware) when budget=0."
    )
    default_ratio: float = _f(
        2.0, "Host pool size as a multiple of the device pool when a pool asks for none."
    )
    shm_prefix: str = _f("hicached", "Prefix of the daemon's shared-memory segment names.")
    prefault: bool = _f(True, "Prefault host pools at creation (first touch is ~8x slower than a warm copy).")
    warm_restart: bool = _f(
        False,
        "Keep host pools and the content index across a clean restart (segments stay in /dev/shm; "
        "the next daemon with the same shm_prefix re-maps them).",
    )
    journal_dir: str = _f(
        lambda: str(_cache_dir() / "l2"),
        "Directory of the warm-restart journals (one per pool group, written on clean shutdown).",
    )

    def budget_bytes(self) -> int:
        return self.budget if self.budget > 0 else int(available_memory_bytes() * self.budget_fraction)


@dataclass(frozen=True)
class SessionConfig:
    lease_ms: int = _f(10_000, "Default session lease; a session missing heartbeats this long is ended.")
    min_lease_ms: int = _f(500, "Smallest lease a worker may ask for.")
    max_lease_ms: int = _f(300_000, "Largest lease a worker may ask for.")
    retraction_lease_ms: int = _f(60_000, "Default time a retraction backup is guaranteed resident.")
    op_cache_size: int = _f(4096, "Operation ids remembered per session for idempotent retries.")


@dataclass(frozen=True)
class CopyConfig:
    workers: int = _f(2, "Copy engine worker threads (node-wide).")
    max_queued: int = _f(
        1 << 30, "Bytes of copies that may wait before RESOURCE_EXHAUSTED.", parse=parse_size
    )


@dataclass(frozen=True)
class L3Config:
    backend: str = _f("file", "Storage backend: file, redis, s3, mooncake, or none.")
    path: str = _f(lambda: str(_cache_dir() / "l3"), "Directory of the file backend.")
    capacity: int = _f(16 << 30, "Capacity of the file backend in bytes (LRU beyond).", parse=parse_size)
    url: str = _f("", "Address of a remote backend (redis://..., http://s3-endpoint, mooncake master).")
    bucket: str = _f("hicached", "Bucket of the s3 backend.")
    write_policy: str = _f("write_through", "write_through, write_through_selective or write_back.")
    prefetch_policy: str = _f("best_effort", "best_effort, wait_complete or timeout.")
    prefetch_timeout_base_s: float = _f(1.0, "Timeout policy: base seconds.")
    prefetch_timeout_per_1k_tokens_s: float = _f(0.25, "Timeout policy: seconds per 1024 tokens.")
    io_workers: int = _f(2, "Threads doing L3 I/O.")


@dataclass(frozen=True)
class LogConfig:
    level: str = _f("info", "debug, info, warning or error.")
    format: str = _f("text", "text or json (one JSON object per line).")


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    host: HostConfig = field(default_factory=HostConfig)
    sessions: SessionConfig = field(default_factory=SessionConfig)
    copy: CopyConfig = field(default_factory=CopyConfig)
    l3: L3Config = field(default_factory=L3Config)
    log: LogConfig = field(default_factory=LogConfig)


_CHOICES: dict[str, tuple[str, ...]] = {
    "l3.backend": ("file", "redis", "s3", "mooncake", "none"),
    "l3.write_policy": ("write_through", "write_through_selective", "write_back"),
    "l3.prefetch_policy": ("best_effort", "wait_complete", "timeout"),
    "log.level": ("debug", "info", "warning", "error"),
    "log.format": ("text", "json"),
}
_POSITIVE = {
    "server.max_batch_pages",
    "server.max_message_bytes",
    "sessions.lease_ms",
    "sessions.min_lease_ms",
    "sessions.max_lease_ms",
    "sessions.retraction_lease_ms",
    "sessions.op_cache_size",
    "copy.workers",
    "copy.max_queued",
    "l3.capacity",
    "l3.io_workers",
    "host.default_ratio",
}


_SECTION_TYPES: dict[str, type[Any]] = {
    "server": ServerConfig,
    "host": HostConfig,
    "sessions": SessionConfig,
    "copy": CopyConfig,
    "l3": L3Config,
    "log": LogConfig,
}


def _allowed(key: str, f: dataclasses.Field[Any]) -> str:
    if key in _CHOICES:
        return "one of " + ", ".join(_CHOICES[key])
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if "parse" in f.metadata:
        return "a size such as 512MiB, 4GiB or a byte count"
    return {
        "int": "an integer",
        "float": "a number",
        "bool": "true or false",
        "str": "a string",
        "Path": "a path",
    }.get(str(kind), str(kind))


def _coerce(key: str, f: dataclasses.Field[Any], value: Any) -> Any:
    kind = str(f.type)
    try:
        if "parse" in f.metadata:
            out = f.metadata["parse"](value)
        elif kind == "bool":
            if isinstance(value, bool):
                out = value
            elif str(value).lower() in ("1", "true", "yes", "on"):
                out = True
            elif str(value).lower() in ("0", "false", "no", "off"):
                out = False
            else:
                raise ValueError(value)
        elif kind == "int":
            if isinstance(value, bool) or not isinstance(value, int | str):
                raise ValueError(value)  # 2.5 is not silently 2
            out = int(value, 0) if isinstance(value, str) else value
        elif kind == "float":
            if isinstance(value, bool):
                raise ValueError(value)
            out = float(value)
        elif isinstance(value, str):
            out = Path(value) if kind == "Path" else value
        else:
            raise ValueError(value)  # a TOML number or boolean where text is expected
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid {key} = {value!r}: expected {_allowed(key, f)}") from exc
    if key in _CHOICES and out not in _CHOICES[key]:
        raise ConfigError(f"invalid {key} = {value!r}: expected {_allowed(key, f)}")
    if key in _POSITIVE and out <= 0:
        raise ConfigError(f"invalid {key} = {value!r}: must be > 0")
    return out


def _fields(section: str) -> dict[str, dataclasses.Field[Any]]:
    return {f.name: f for f in dataclasses.fields(_SECTION_TYPES[section])}


def _check_cross(cfg: Config) -> None:
    s = cfg.sessions
    if not s.min_lease_ms <= s.lease_ms <= s.max_lease_ms:
        raise ConfigError(
            f"invalid sessions.lease_ms = {s.lease_ms}: must lie in "
            f"[sessions.min_lease_ms={s.min_lease_ms}, sessions.max_lease_ms={s.max_lease_ms}]"
        )
    if not 0 < cfg.host.budget_fraction <= 1:
        raise ConfigError(f"invalid host.budget_fraction = {cfg.host.budget_fraction}: must lie in (0, 1]")
    if bool(cfg.server.tls_cert) != bool(cfg.server.tls_key):
        given, missing = (
            ("server.tls_cert", "server.tls_key")
            if cfg.server.tls_cert
            else ("server.tls_key", "server.tls_cert")
        )
        value = cfg.server.tls_cert or cfg.server.tls_key
        raise ConfigError(f"{given} = {value!r} is set but {missing} is not: TLS needs both")
    for key, number in (
        ("server.grace_s", cfg.server.grace_s),
        ("l3.prefetch_timeout_base_s", cfg.l3.prefetch_timeout_base_s),
        ("l3.prefetch_timeout_per_1k_tokens_s", cfg.l3.prefetch_timeout_per_1k_tokens_s),
    ):
        if number < 0:
            raise ConfigError(f"invalid {key} = {number}: must be >= 0")
    if cfg.server.metrics_port < -1 or cfg.server.metrics_port > 65535:
        raise ConfigError(
            f"invalid server.metrics_port = {cfg.server.metrics_port}: expected -1, 0 or a port"
        )


def env_var(key: str) -> str:
    """``server.socket`` -> ``HICACHED_SERVER_SOCKET``."""
    return "HICACHED_" + key.replace(".", "_").upper()


def resolve(
    cli: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    file: Path | None = None,
) -> Config:
    """Build the configuration: ``cli`` (dotted keys) > ``env`` > ``file`` > defaults.

    ``env`` defaults to ``os.environ``; ``file`` defaults to ``$HICACHED_CONFIG`` if set.
    """
    env = os.environ if env is None else env
    if file is None and env.get("HICACHED_CONFIG"):
        file = Path(env["HICACHED_CONFIG"])
    layered: dict[str, dict[str, Any]] = {name: {} for name in _SECTION_TYPES}
    if file is not None:
        try:
            data = tomllib.loads(file.read_bytes().decode("utf-8"))
        except OSError as exc:
            raise ConfigError(f"cannot read config file {file}: {exc.strerror}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"config file {file} is not valid UTF-8 (byte {exc.start}: {exc.reason})"
            ) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {file} is not valid TOML: {exc}") from exc
        except RecursionError:
            # tomllib recurses per nesting level; a deep file is a config error, not a crash.
            raise ConfigError(f"config file {file} is nested too deeply to be a configuration") from None
        for section, values in data.items():
            if section not in _SECTION_TYPES or not isinstance(values, dict):
                raise ConfigError(
                    f"unknown section [{section}] in {file}: expected one of {', '.join(_SECTION_TYPES)}"
                )
            for key, value in values.items():
                _set(layered, f"{section}.{key}", value, origin=str(file))
    for section in _SECTION_TYPES:
        for key in _fields(section):
            name = env_var(f"{section}.{key}")
            if name in env:
                _set(layered, f"{section}.{key}", env[name], origin=name)
    for dotted, value in (cli or {}).items():
        if value is not None:
            _set(layered, dotted, value, origin="command line")
    cfg = Config(**{name: _SECTION_TYPES[name](**vals) for name, vals in layered.items()})
    _check_cross(cfg)
    return cfg


def _set(layered: dict[str, dict[str, Any]], dotted: str, value: Any, *, origin: str) -> None:
    section, _, key = dotted.partition(".")
    fields = _fields(section) if section in _SECTION_TYPES else {}
    if key not in fields:
        known = ", ".join(f"{section}.{k}" for k in fields) if fields else ", ".join(_SECTION_TYPES)
        raise ConfigError(f"unknown configuration key {dotted!r} (from {origin}); known: {known}")
    layered[section][key] = _coerce(dotted, fields[key], value)


def as_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """TOML-ready nested dict (paths as strings)."""
    out: dict[str, dict[str, Any]] = {}
    for name in _SECTION_TYPES:
        section = getattr(cfg, name)
        out[name] = {
            f.name: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v)
            for f in dataclasses.fields(section)
            for v in [getattr(section, f.name)]
        }
    return out


def describe() -> list[tuple[str, str, str, str]]:
    """(key, default, env var, help) for every key, for docs and ``config show --keys``."""
    rows = []
    defaults = Config()
    for name, cls in _SECTION_TYPES.items():
        for f in dataclasses.fields(cls):
            key = f"{name}.{f.name}"
            rows.append(
                (key, repr(getattr(getattr(defaults, name), f.name)), env_var(key), f.metadata["help"])
            )
    return rows
