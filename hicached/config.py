"""The daemon's configuration: frozen dataclasses resolved in one place.

Precedence: CLI flags > environment (``HICACHED_<SECTION>_<KEY>``) > TOML file
(``[section] key = value``) > embedded defaults. ``resolve()`` is the only
function that reads any of those sources; everything else receives a
``Config``. An invalid value stops startup with ``ConfigError`` naming the key,
the value and what is allowed — there is no silent fallback.

Each field's ``metadata["help"]`` documents it; ``hicached config show`` and the
README's configuration reference are generated from the same table
(``describe()``).

The L3 backends' options are tables (``[l3.redis]``, ``HICACHED_L3_REDIS_HOST``,
``--set l3.redis.host=...``) that resolve straight into each backend's own frozen
config dataclass (``hicached/l3/<backend>.py``). Every value, the daemon's and the
backends', goes through one typed coercer (:mod:`hicached.coerce`): TOML values
must have the field's type, environment and command-line text is parsed.
Permission modes are octal everywhere: ``0o660`` in TOML (a bare decimal literal
is refused as ambiguous), ``660``/``0660``/``0o660`` as text.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicached.coerce import coerce, format_mode, parse_size, type_hints
from hicached.errors import InvalidArgument
from hicached.l3.file import FileBackendConfig
from hicached.l3.mooncake import MooncakeBackendConfig
from hicached.l3.redis import RedisBackendConfig
from hicached.l3.s3 import S3BackendConfig

__all__ = ["Config", "ConfigError", "default_cache_dir", "parse_size", "resolve"]


class ConfigError(InvalidArgument):
    """An invalid configuration value (names key, value and what is allowed)."""


def _runtime_dir() -> Path:
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "hicached"
    if os.geteuid() == 0:
        return Path("/run/hicached")
    return Path(f"/tmp/hicached-{os.geteuid()}")


def default_cache_dir() -> Path:
    """Parent of the default L3 path and journal directory (XDG_CACHE_HOME, root, else HOME)."""
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


def _f(
    default: Any, help: str, *, parse: Callable[[Any], Any] | None = None, mode: bool = False, **kw: Any
) -> Any:
    meta: dict[str, Any] = {"help": help}
    if parse is not None:
        meta["parse"] = parse
    if mode:
        meta["mode"] = True  # octal permission bits: text is octal, written back as 0o660
    if callable(default) and not isinstance(default, type):
        return field(default_factory=default, metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


@dataclass(frozen=True)
class ServerConfig:
    socket: Path = _f(lambda: _runtime_dir() / "hicached.sock", "Unix socket path the daemon listens on.")
    socket_mode: int = _f(
        0o660, "Permission bits of the socket file (octal: 0o660 in TOML, 660 in env/--set).", mode=True
    )
    admin_socket: str = _f(
        "",
        "Unix socket of the admin role (Drain, Resume, ClearNamespace, full GetStats); empty = "
        "admin.sock next to server.socket. Mode 0600, or 0660 with group server.admin_group.",
    )
    admin_group: str = _f(
        "", "Group (name or gid) whose members may use the admin socket (empty = the daemon's user only)."
    )
    admin_token_file: str = _f(
        "", "File holding the bearer token of the admin role on TCP (must differ from the worker token)."
    )
    insecure_tcp: bool = _f(
        False, "Serve server.listen without a token or mTLS (every TCP client is a worker; logs a warning)."
    )
    listen: str = _f("", "Also listen on TCP HOST:PORT (empty = Unix socket only).")
    auth_token_file: str = _f("", "File holding the bearer token required on TCP (empty = none).")
    tls_cert: str = _f("", "PEM certificate for TCP (with tls_key enables TLS).")
    tls_key: str = _f("", "PEM private key for TCP.")
    tls_client_ca: str = _f("", "PEM CA bundle; when set, TCP clients must present a certificate (mTLS).")
    max_batch_pages: int = _f(1 << 16, "Largest number of pages one request may carry.")
    max_message_bytes: int = _f(64 << 20, "Largest gRPC message (bytes).", parse=parse_size)
    metrics_host: str = _f("127.0.0.1", "Address of the Prometheus /metrics HTTP server.")
    metrics_port: int = _f(-1, "Port of /metrics (-1 = disabled, 0 = any free port).")
    grace_s: float = _f(
        10.0,
        "Shutdown budget on SIGTERM (seconds): in-flight RPCs get up to half, the L3 flush the rest; "
        "keep the pod's terminationGracePeriodSeconds >= grace_s + 15 (journals, exit).",
    )
    handoff_max_fds: int = _f(64, "Most file descriptors one fd handoff (socket <socket>.fds) may carry.")
    handoff_ticket_ttl_s: float = _f(30.0, "Seconds an fd handoff ticket waits for its Attach.")
    handoff_max_pending: int = _f(256, "Most unused fd handoff tickets in total.")
    handoff_max_pending_per_uid: int = _f(32, "Most unused fd handoff tickets per client uid.")
    fast_lane: bool = _f(
        True, "Serve the fast lane (<socket>.lane: shared-memory rings for Write/Load; see docs/fastlane.md)."
    )
    fast_lane_max: int = _f(64, "Most fast lanes (open or negotiating) in total; each holds one thread.")
    fast_lane_max_per_session: int = _f(4, "Most open fast lanes per session.")
    fast_lane_max_per_uid: int = _f(16, "Most open fast lanes per client uid (SO_PEERCRED).")
    copy_threads: int = _f(
        16, "Threads that run copy-bound RPCs (Write, Load, PutPages, GetPages, PutBytes, Detach...)."
    )
    l3_threads: int = _f(
        8, "Threads that run RPCs waiting on L3 (include_l3, Lookup with L3, Backup, Prefetch...)."
    )
    hash_threads: int = _f(
        2, "Threads that hash token chains and check keys (CPU-bound; off the event loop)."
    )
    bookkeeping_threads: int = _f(
        8,
        "Threads of short bookkeeping (Attach, GetStats, the lease reaper): never shared with copies or L3.",
    )

    def admin_socket_path(self) -> Path:
        """The admin socket: ``admin_socket``, or ``admin.sock`` next to the worker socket."""
        return Path(self.admin_socket) if self.admin_socket else Path(self.socket).parent / "admin.sock"


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
        lambda: str(default_cache_dir() / "l2"),
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
    op_cache_bytes: int = _f(
        4 << 20, "Bytes of remembered answers per session for idempotent retries (LRU).", parse=parse_size
    )


@dataclass(frozen=True)
class CopyConfig:
    workers: int = _f(2, "Copy engine worker threads (node-wide).")
    max_queued: int = _f(
        1 << 30, "Bytes of copies that may wait before RESOURCE_EXHAUSTED.", parse=parse_size
    )


def _default_file_backend() -> FileBackendConfig:
    return FileBackendConfig(path=str(default_cache_dir() / "l3"), capacity_bytes=16 << 30)


# Each backend's table ([l3.file], [l3.redis], ...) is that backend's own config dataclass;
# the daemon's defaults for the options a backend requires are given here.
_BACKEND_HELP = "Options of the {} backend (table [l3.{}]; see the l3.{}.* keys)."


@dataclass(frozen=True)
class L3Config:
    backend: str = _f("file", "Storage backend: file, redis, s3, mooncake, or none.")
    write_policy: str = _f("write_through", "write_through, write_through_selective or write_back.")
    prefetch_policy: str = _f("best_effort", "best_effort, wait_complete or timeout.")
    prefetch_timeout_base_s: float = _f(1.0, "Timeout policy: base seconds.")
    prefetch_timeout_per_1k_tokens_s: float = _f(0.25, "Timeout policy: seconds per 1024 tokens.")
    io_workers: int = _f(2, "Threads doing L3 I/O.")
    stats_interval_s: float = _f(
        5.0, "Seconds between background refreshes of the L3 backend's stats (GetStats answers from them)."
    )
    stats_wait_s: float = _f(
        0.5,
        "Longest GetStats waits for a fresh L3 stats refresh before answering the last stats (0 = never).",
    )
    file: FileBackendConfig = _f(_default_file_backend, _BACKEND_HELP.format("file", "file", "file"))
    redis: RedisBackendConfig = field(
        default_factory=RedisBackendConfig, metadata={"help": _BACKEND_HELP.format("redis", "redis", "redis")}
    )
    s3: S3BackendConfig = _f(
        lambda: S3BackendConfig(bucket="hicached"), _BACKEND_HELP.format("s3", "s3", "s3")
    )
    mooncake: MooncakeBackendConfig = _f(
        lambda: MooncakeBackendConfig(master_addr="127.0.0.1:50051"),
        _BACKEND_HELP.format("mooncake", "mooncake", "mooncake"),
    )

    def backend_config(self) -> Any:
        """The selected backend's config dataclass (None for ``backend = "none"``)."""
        return None if self.backend == "none" else getattr(self, self.backend)


@dataclass(frozen=True)
class LimitsConfig:
    """Per-request and per-peer limits, checked before any work starts (see docs/limits.md)."""

    max_tokens_per_request: int = _f(1 << 20, "Most token ids one KeySource.tokens chain may carry.")
    max_keys_per_request: int = _f(1 << 16, "Most keys one request may carry (given or hashed from tokens).")
    max_key_bytes: int = _f(512, "Longest key (UTF-8 bytes).")
    max_identity_bytes: int = _f(
        256, "Longest identity string (instance_id, model_name, tenant, op_id, request_id; UTF-8 bytes)."
    )
    max_response_bytes: int = _f(
        32 << 20,
        "Largest response a request may ask for, computed before it is built (capped by "
        "server.max_message_bytes).",
        parse=parse_size,
    )
    max_sessions_per_peer: int = _f(
        256, "Most live sessions of one peer (the handoff's SO_PEERCRED uid, the TCP host, or the socket)."
    )
    max_buffers_per_attach: int = _f(
        512, "Most device buffers (K and V of every pool) one Attach may hand over."
    )
    max_l3_calls_queued: int = _f(
        64, "RPCs that may wait for an L3 thread (server.l3_threads) before RESOURCE_EXHAUSTED."
    )
    max_wait_s: float = _f(
        30.0,
        "Deadline of a blocking wait (Backup wait, PrefetchStatus wait, the wait at session end): "
        "past it the call answers the state so far.",
    )


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
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    log: LogConfig = field(default_factory=LogConfig)


_CHOICES: dict[str, tuple[str, ...]] = {
    "l3.backend": ("file", "redis", "s3", "mooncake", "none"),
    "l3.write_policy": ("write_through", "write_through_selective", "write_back"),
    "l3.prefetch_policy": ("best_effort", "wait_complete", "timeout"),
    "log.level": ("debug", "info", "warning", "error"),
    "log.format": ("text", "json"),
}
_POSITIVE = {
    "server.handoff_max_fds",
    "server.handoff_ticket_ttl_s",
    "server.handoff_max_pending",
    "server.handoff_max_pending_per_uid",
    "server.fast_lane_max",
    "server.fast_lane_max_per_session",
    "server.fast_lane_max_per_uid",
    "server.max_batch_pages",
    "server.max_message_bytes",
    "sessions.lease_ms",
    "sessions.min_lease_ms",
    "sessions.max_lease_ms",
    "sessions.retraction_lease_ms",
    "sessions.op_cache_size",
    "sessions.op_cache_bytes",
    "copy.workers",
    "copy.max_queued",
    "l3.io_workers",
    "l3.stats_interval_s",
    "host.default_ratio",
    "server.copy_threads",
    "server.l3_threads",
    "server.hash_threads",
    "server.bookkeeping_threads",
    "limits.max_tokens_per_request",
    "limits.max_keys_per_request",
    "limits.max_key_bytes",
    "limits.max_identity_bytes",
    "limits.max_response_bytes",
    "limits.max_sessions_per_peer",
    "limits.max_buffers_per_attach",
    "limits.max_l3_calls_queued",
    "limits.max_wait_s",
}


_SECTION_TYPES: dict[str, type[Any]] = {
    "server": ServerConfig,
    "host": HostConfig,
    "sessions": SessionConfig,
    "copy": CopyConfig,
    "l3": L3Config,
    "limits": LimitsConfig,
    "log": LogConfig,
}


def _coerce(key: str, f: dataclasses.Field[Any], value: Any, tp: Any = None, *, text: bool = True) -> Any:
    """``value`` for the field ``f`` of ``key``, by the one typed coercer (:mod:`hicached.coerce`)."""
    if tp is None:
        section, _, name = key.partition(".")
        tp = type_hints(_SECTION_TYPES[section])[name]
    if key in _CHOICES and not (isinstance(value, str) and value in _CHOICES[key]):
        raise ConfigError(f"invalid {key} = {value!r}: expected one of {', '.join(_CHOICES[key])}")
    try:
        out = coerce(value, tp, label=key, metadata=f.metadata, text=text)
    except InvalidArgument as exc:
        raise ConfigError(str(exc)) from exc
    if key in _POSITIVE and out <= 0:
        raise ConfigError(f"invalid {key} = {value!r}: must be > 0")
    return out


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
    _check_tcp(cfg.server)
    for key, number in (
        ("server.grace_s", cfg.server.grace_s),
        ("l3.prefetch_timeout_base_s", cfg.l3.prefetch_timeout_base_s),
        ("l3.prefetch_timeout_per_1k_tokens_s", cfg.l3.prefetch_timeout_per_1k_tokens_s),
        ("l3.stats_wait_s", cfg.l3.stats_wait_s),
    ):
        if number < 0:
            raise ConfigError(f"invalid {key} = {number}: must be >= 0")
    if cfg.server.metrics_port < -1 or cfg.server.metrics_port > 65535:
        raise ConfigError(
            f"invalid server.metrics_port = {cfg.server.metrics_port}: expected -1, 0 or a port"
        )


def _check_tcp(server: ServerConfig) -> None:
    """TCP fails closed: a listener needs a token or mTLS unless insecure_tcp says otherwise."""
    if server.tls_client_ca and not server.tls_cert:
        raise ConfigError(
            f"server.tls_client_ca = {server.tls_client_ca!r} is set but server.tls_cert is not: "
            "mTLS needs server.tls_cert and server.tls_key (without them TCP would be plaintext)"
        )
    if server.listen and not (server.auth_token_file or server.tls_client_ca or server.insecure_tcp):
        raise ConfigError(
            f"server.listen = {server.listen!r} needs server.auth_token_file or server.tls_client_ca "
            "(mTLS); set server.insecure_tcp = true to serve TCP without authentication"
        )
    if server.admin_socket and Path(server.admin_socket) == Path(server.socket):
        raise ConfigError(f"server.admin_socket = {server.admin_socket!r} must differ from server.socket")


def env_var(key: str) -> str:
    """``server.socket`` -> ``HICACHED_SERVER_SOCKET``; ``l3.redis.host`` -> ``HICACHED_L3_REDIS_HOST``."""
    return "HICACHED_" + key.replace(".", "_").upper()


# Documented aliases of backend options (the loose [l3] keys of earlier versions).
ALIASES: dict[str, str] = {"l3.path": "l3.file.path", "l3.capacity": "l3.file.capacity_bytes"}
# Keys that were removed, with what replaces them (an error names the replacement).
_REMOVED: dict[str, str] = {
    "l3.url": "l3.redis.host/l3.redis.port, l3.s3.endpoint_url or l3.mooncake.master_addr",
    "l3.bucket": "l3.s3.bucket",
}
# HICACHED_* variables that are not configuration keys but are read elsewhere.
OTHER_ENV: dict[str, str] = {
    "HICACHED_CONFIG": "the configuration file",
    "HICACHED_SOCKET": "the daemon address clients connect to",
    "HICACHED_PYTHON": "the Python ./dev uses",
    "HICACHED_TORCH": "the torch wheel ./dev installs",
}


def _tables(section: str) -> dict[str, type[Any]]:
    """``{table name: config dataclass}`` of the sub-tables of ``section`` (``[l3.redis]``...)."""
    hints = type_hints(_SECTION_TYPES[section])
    return {
        f.name: hints[f.name]
        for f in dataclasses.fields(_SECTION_TYPES[section])
        if dataclasses.is_dataclass(hints[f.name])
    }


def _all_keys() -> list[tuple[str, dataclasses.Field[Any], Any]]:
    """``(dotted key, field, type)`` of every settable key, tables' options included."""
    out = []
    for section, cls in _SECTION_TYPES.items():
        hints = type_hints(cls)
        tables = _tables(section)
        for f in dataclasses.fields(cls):
            if f.name not in tables:
                out.append((f"{section}.{f.name}", f, hints[f.name]))
                continue
            table_hints = type_hints(tables[f.name])
            for g in dataclasses.fields(tables[f.name]):
                out.append((f"{section}.{f.name}.{g.name}", g, table_hints[g.name]))
    return out


def _flatten(prefix: str, data: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """TOML tables -> dotted keys (``{"l3": {"redis": {"host": h}}}`` -> ``l3.redis.host``)."""
    out: list[tuple[str, Any]] = []
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict) and dotted.count(".") < 2 and dotted not in _KEYS:
            out.extend(_flatten(dotted, value))
        else:
            out.append((dotted, value))
    return out


_MODE_LITERAL = re.compile(r"^\s*(\w+)\s*=\s*([^\s#]+)", re.MULTILINE)


def _check_mode_literals(text: str, file: Path) -> None:
    """A mode written as a bare decimal in TOML (``socket_mode = 660``) is refused, not
    taken as decimal: TOML has no implicit octal, so write ``0o660`` or ``"660"``."""
    modes = {key.rpartition(".")[2]: key for key, f, _ in _all_keys() if f.metadata.get("mode")}
    for name, literal in _MODE_LITERAL.findall(text):
        if name in modes and literal[:1].isdigit() and not literal.lower().startswith("0o"):
            raise ConfigError(
                f"invalid {modes[name]} = {literal} in {file}: a permission mode must be written "
                f'in octal, e.g. {name} = 0o660 (or "660")'
            )


def resolve(
    cli: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    file: Path | None = None,
) -> Config:
    """Build the configuration: ``cli`` (dotted keys) > ``env`` > ``file`` > defaults.

    ``env`` defaults to ``os.environ``; ``file`` defaults to ``$HICACHED_CONFIG`` if set.
    Backend tables (``[l3.redis]``, ``HICACHED_L3_REDIS_HOST``, ``--set l3.redis.host=...``)
    go through the same coercer and end as that backend's own config dataclass.
    """
    env = os.environ if env is None else env
    if file is None and env.get("HICACHED_CONFIG"):
        file = Path(env["HICACHED_CONFIG"])
    layered: dict[str, dict[str, Any]] = {name: {} for name in _SECTION_TYPES}
    if file is not None:
        try:
            text = file.read_bytes().decode("utf-8")
            data = tomllib.loads(text)
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
        _check_mode_literals(text, file)
        for section, values in data.items():
            if section not in _SECTION_TYPES or not isinstance(values, dict):
                raise ConfigError(
                    f"unknown section [{section}] in {file}: expected one of {', '.join(_SECTION_TYPES)}"
                )
            for dotted, value in _flatten(section, values):
                _set(layered, dotted, value, origin=str(file), text=False)
    for alias in ALIASES:
        if env_var(alias) in env:
            _set(layered, alias, env[env_var(alias)], origin=env_var(alias))
    for key in _KEYS:
        name = env_var(key)
        if name in env:
            _set(layered, key, env[name], origin=name)
    for dotted, value in (cli or {}).items():
        if value is not None:
            _set(layered, dotted, value, origin="command line")
    defaults = Config()
    sections = {}
    for name, vals in layered.items():
        tables = {
            table: _build_table(name, table, getattr(getattr(defaults, name), table), vals.pop(table))
            for table in _tables(name)
            if table in vals
        }
        sections[name] = _SECTION_TYPES[name](**vals, **tables)
    cfg = Config(**sections)
    _check_cross(cfg)
    return cfg


def _build_table(section: str, table: str, default: Any, values: Mapping[str, Any]) -> Any:
    try:
        return dataclasses.replace(default, **values)
    except InvalidArgument as exc:  # the backend's own cross-checks (__post_init__)
        raise ConfigError(f"invalid [{section}.{table}]: {exc}") from exc


def _set(
    layered: dict[str, dict[str, Any]], dotted: str, value: Any, *, origin: str, text: bool = True
) -> None:
    dotted = ALIASES.get(dotted, dotted)
    if dotted in _REMOVED:
        raise ConfigError(f"configuration key {dotted!r} (from {origin}) was removed: use {_REMOVED[dotted]}")
    entry = _KEYS.get(dotted)
    if entry is None:
        section, _, rest = dotted.partition(".")
        table = rest.partition(".")[0]
        if section in _SECTION_TYPES and table in _tables(section):
            scope = f"{section}.{table}."
        elif section in _SECTION_TYPES:
            scope = f"{section}."
        else:
            scope = ""
        known = ", ".join(k for k in _KEYS if k.startswith(scope) and k.count(".") == scope.count("."))
        raise ConfigError(
            f"unknown configuration key {dotted!r} (from {origin}); known: "
            + (known if scope else ", ".join(_SECTION_TYPES))
        )
    f, tp = entry
    coerced = _coerce(dotted, f, value, tp, text=text)
    parts = dotted.split(".")
    if len(parts) == 3:
        layered[parts[0]].setdefault(parts[1], {})[parts[2]] = coerced
    else:
        layered[parts[0]][parts[1]] = coerced


def _plain(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else list(value) if isinstance(value, tuple) else value


def as_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """TOML-ready nested dict (paths as strings; backend tables as nested dicts, unset options left out)."""
    out: dict[str, dict[str, Any]] = {}
    for name in _SECTION_TYPES:
        section = getattr(cfg, name)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(section):
            v = getattr(section, f.name)
            if dataclasses.is_dataclass(v):
                values[f.name] = {
                    g.name: _plain(getattr(v, g.name))
                    for g in dataclasses.fields(v)
                    if getattr(v, g.name) is not None
                }
            else:
                values[f.name] = _plain(v)
        out[name] = values
    return out


def toml_value(key: str, value: Any) -> str:
    """``value`` of ``key`` as TOML text (modes in octal: ``0o660``)."""
    entry = _KEYS.get(key)
    if entry is not None and entry[0].metadata.get("mode") and isinstance(value, int):
        return format_mode(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value("", v) for v in value) + "]"
    return json.dumps(str(value))


def to_toml(cfg: Config) -> str:
    """The configuration as a TOML document that :func:`resolve` reads back to ``cfg``."""
    lines: list[str] = []
    for section, values in as_dict(cfg).items():
        lines.append(f"[{section}]")
        tables = {k: v for k, v in values.items() if isinstance(v, dict)}
        lines += [f"{k} = {toml_value(f'{section}.{k}', v)}" for k, v in values.items() if k not in tables]
        lines.append("")
        for table, options in tables.items():
            lines.append(f"[{section}.{table}]")
            lines += [f"{k} = {toml_value(f'{section}.{table}.{k}', v)}" for k, v in options.items()]
            lines.append("")
    return "\n".join(lines)


def unknown_env(env: Mapping[str, str] | None = None) -> list[str]:
    """One warning per ``HICACHED_*`` variable that is no configuration key (a typo is never silent)."""
    env = os.environ if env is None else env
    known = {env_var(k) for k in _KEYS} | {env_var(a) for a in ALIASES} | set(OTHER_ENV)
    warnings = []
    for name in sorted(env):
        if not name.startswith("HICACHED_") or name in known:
            continue
        close = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f"; did you mean {close[0]}?" if close else "; see `hicached config show --keys`"
        warnings.append(f"environment variable {name} is not a hicached setting and is ignored{hint}")
    return warnings


def describe() -> list[tuple[str, str, str, str]]:
    """(key, default, env var, help) for every key, for docs and ``config show --keys``.

    Defaults are written as in TOML (``0o660``, ``"text"``, ``true``); an option without
    a value (``None``) is ``unset``.
    """
    rows = []
    defaults = as_dict(Config())
    for key, f, _ in _all_keys():
        value: Any = defaults
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        shown = "unset" if value is None else toml_value(key, value)
        rows.append((key, shown, env_var(key), f.metadata.get("help", "")))
    return rows


_KEYS: dict[str, tuple[dataclasses.Field[Any], Any]] = {key: (f, tp) for key, f, tp in _all_keys()}
