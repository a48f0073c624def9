"""Resolution of the configuration: CLI > environment > TOML file > defaults.

:func:`resolve` is the only function that reads any of those sources; every value
goes through one typed coercer (:mod:`hicached.coerce`), is checked against its
allowed choices and ranges, then the sections are cross-checked. Pure functions
over immutable tables: thread-safe.
"""

from __future__ import annotations

import dataclasses
import os
import re
import select
import stat
import time
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hicached.coerce import coerce, type_hints
from hicached.config.sections import SECTION_TYPES, Config, ConfigError, ServerConfig
from hicached.errors import InvalidArgument, clip

__all__ = ["ALIASES", "KEYS", "OTHER_ENV", "all_keys", "env_var", "resolve"]


_POSITIVE = {
    "server.handoff_max_fds",
    "server.handoff_ticket_ttl_s",
    "server.handoff_max_pending",
    "server.handoff_max_pending_per_uid",
    "server.handoff_max_pending_fds_per_uid",
    "server.fast_lane_max",
    "server.fast_lane_max_per_session",
    "server.fast_lane_max_per_uid",
    "server.max_batch_pages",
    "server.max_message_bytes",
    "server.max_connections",
    "server.max_streams_per_connection",
    "server.max_health_watchers",
    "server.idle_connection_s",
    "server.keepalive_s",
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
    "limits.max_unread_answer_bytes_per_peer",
    "limits.max_request_bytes_held_per_peer",
    "limits.max_sessions_per_peer",
    "limits.max_buffer_bytes_per_peer",
    "limits.max_mappings_per_peer",
    "limits.max_buffers_per_attach",
    "limits.max_pools_per_attach",
    "limits.max_layers_per_pool",
    "limits.max_l3_calls_queued",
    "limits.max_copy_calls_per_session",
    "limits.max_l3_calls_per_session",
    "limits.max_hash_calls_queued",
    "host.max_groups",
    "limits.max_hash_calls_per_session",
    "limits.max_alloc_calls_per_session",
    "limits.max_prefetches_per_session",
    "limits.max_prefetch_keys_per_peer",
    "limits.max_wait_s",
}


def _coerce(key: str, f: dataclasses.Field[Any], value: Any, tp: Any = None, *, text: bool = True) -> Any:
    """``value`` for the field ``f`` of ``key``, by the one typed coercer (:mod:`hicached.coerce`)."""
    if tp is None:
        section, _, name = key.partition(".")
        tp = type_hints(SECTION_TYPES[section])[name]
    try:
        out = coerce(value, tp, label=key, metadata=f.metadata, text=text)
    except InvalidArgument as exc:
        raise ConfigError(str(exc)) from exc
    if key in _POSITIVE and out <= 0:
        raise ConfigError(f"invalid {key} = {clip(value)}: must be > 0")
    return out


def _check_cross(cfg: Config) -> None:
    s = cfg.sessions
    if not s.min_lease_ms <= s.lease_ms <= s.max_lease_ms:
        raise ConfigError(
            f"invalid sessions.lease_ms = {clip(s.lease_ms)}: must lie in "
            f"[sessions.min_lease_ms={s.min_lease_ms}, sessions.max_lease_ms={s.max_lease_ms}]"
        )
    if not 0 < cfg.host.budget_fraction <= 1:
        raise ConfigError(
            f"invalid host.budget_fraction = {clip(cfg.host.budget_fraction)}: must lie in (0, 1]"
        )
    if bool(cfg.server.tls_cert) != bool(cfg.server.tls_key):
        given, missing = (
            ("server.tls_cert", "server.tls_key")
            if cfg.server.tls_cert
            else ("server.tls_key", "server.tls_cert")
        )
        value = cfg.server.tls_cert or cfg.server.tls_key
        raise ConfigError(f"{given} = {clip(value)} is set but {missing} is not: TLS needs both")
    _check_tcp(cfg.server)
    for key, number in (
        ("server.grace_s", cfg.server.grace_s),
        ("l3.prefetch_timeout_base_s", cfg.l3.prefetch_timeout_base_s),
        ("l3.prefetch_timeout_per_1k_tokens_s", cfg.l3.prefetch_timeout_per_1k_tokens_s),
        ("l3.stats_wait_s", cfg.l3.stats_wait_s),
        ("log.max_rate", cfg.log.max_rate),
    ):
        if number < 0:
            raise ConfigError(f"invalid {key} = {clip(number)}: must be >= 0")
    for key, number, most in (  # gRPC takes these as 32-bit ints (milliseconds)
        ("server.idle_connection_s", cfg.server.idle_connection_s, 86_400),
        ("server.keepalive_s", cfg.server.keepalive_s, 86_400),
        ("server.max_connections", cfg.server.max_connections, 1 << 20),
        ("server.max_streams_per_connection", cfg.server.max_streams_per_connection, 1 << 20),
    ):
        if number > most:
            raise ConfigError(f"invalid {key} = {clip(number)}: must be <= {most}")
    if cfg.server.metrics_port < -1 or cfg.server.metrics_port > 65535:
        raise ConfigError(
            f"invalid server.metrics_port = {cfg.server.metrics_port}: expected -1, 0 or a port"
        )
    _check_bounds(cfg)


# Longest shutdown budget: a day. Beyond it a value is a typo, and from ~1e12 s a thread
# join or grpc stop overflows time_t at SIGTERM (the daemon crashed instead of flushing).
MAX_GRACE_S = 86400.0
# gRPC takes its message limits as a C int.
MAX_MESSAGE_BYTES = 2**31 - 1
# Segment names are "{prefix}-{daemon id}-{group id}-{pool}" (at most 200 characters, see
# hicached/shm.py) and the owner record ".{prefix}-..." lives in /dev/shm: the prefix is
# one plain file-name word, short enough to leave the pool name its room.
SHM_PREFIX_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_LISTEN_RE = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[^\s:\[\]/]+):(?P<port>\d{1,5})")


def _check_bounds(cfg: Config) -> None:
    """Values that the type allows but that cannot work: refused here, naming the key, rather
    than failing as a traceback at start or at SIGTERM, or as every client's error."""
    server = cfg.server
    if server.grace_s > MAX_GRACE_S:
        raise ConfigError(f"invalid server.grace_s = {server.grace_s:g}: must be <= {MAX_GRACE_S:g}")
    if server.max_message_bytes > MAX_MESSAGE_BYTES:
        raise ConfigError(
            f"invalid server.max_message_bytes = {server.max_message_bytes}: must be <= {MAX_MESSAGE_BYTES} "
            "(2GiB - 1, gRPC's limit)"
        )
    if not SHM_PREFIX_RE.fullmatch(cfg.host.shm_prefix):
        raise ConfigError(
            f"invalid host.shm_prefix = {clip(cfg.host.shm_prefix)}: use 1..64 of A-Z a-z 0-9 _ . - "
            "(not starting with . or -)"
        )


def _check_tcp(server: ServerConfig) -> None:
    """TCP fails closed: a listener needs a token or mTLS unless insecure_tcp says otherwise.
    Its address is checked first: a malformed one is the error to fix before any other."""
    listen = _LISTEN_RE.fullmatch(server.listen)
    if server.listen and (listen is None or int(listen.group("port")) > 65535):
        raise ConfigError(
            f"invalid server.listen = {clip(server.listen)}: expected HOST:PORT, e.g. 0.0.0.0:50051, "
            "[::]:50051 or localhost:0"
        )
    if server.tls_client_ca and not server.tls_cert:
        raise ConfigError(
            f"server.tls_client_ca = {clip(server.tls_client_ca)} is set but server.tls_cert is not: "
            "mTLS needs server.tls_cert and server.tls_key (without them TCP would be plaintext)"
        )
    if server.listen and not (server.auth_token_file or server.tls_client_ca or server.insecure_tcp):
        raise ConfigError(
            f"server.listen = {clip(server.listen)} needs server.auth_token_file or server.tls_client_ca "
            "(mTLS); set server.insecure_tcp = true to serve TCP without authentication"
        )
    if server.admin_socket_path() == Path(server.socket):
        raise ConfigError(
            f"server.admin_socket = {clip(str(server.admin_socket_path()))} must differ from server.socket"
            + (
                ""
                if server.admin_socket
                else " (admin.sock next to it when unset: name the worker socket otherwise)"
            )
        )


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
    "HICACHED_ADMIN_SOCKET": "the admin socket `hicached status` connects to",
    "HICACHED_DAEMON_UID": "the uid of a daemon that runs as another user, which clients trust",
    "HICACHED_DEV_REINSTALL": "./dev installs again",
    "HICACHED_PYTHON": "the Python ./dev uses",
    "HICACHED_TORCH": "the torch wheel ./dev installs",
}


def _tables(section: str) -> dict[str, type[Any]]:
    """``{table name: config dataclass}`` of the sub-tables of ``section`` (``[l3.redis]``...)."""
    hints = type_hints(SECTION_TYPES[section])
    return {
        f.name: hints[f.name]
        for f in dataclasses.fields(SECTION_TYPES[section])
        if dataclasses.is_dataclass(hints[f.name])
    }


def all_keys() -> list[tuple[str, dataclasses.Field[Any], Any]]:
    """``(dotted key, field, type)`` of every settable key, tables' options included."""
    out = []
    for section, cls in SECTION_TYPES.items():
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
        if isinstance(value, dict) and dotted.count(".") < 2 and dotted not in KEYS:
            out.extend(_flatten(dotted, value))
        else:
            out.append((dotted, value))
    return out


_MODE_LITERAL = re.compile(r"^\s*(\w+)\s*=\s*([^\s#]+)", re.MULTILINE)


def _check_mode_literals(text: str, file: Path) -> None:
    """A mode written as a bare decimal in TOML (``socket_mode = 660``) is refused, not
    taken as decimal: TOML has no implicit octal, so write ``0o660`` or ``"660"``."""
    modes = {key.rpartition(".")[2]: key for key, f, _ in all_keys() if f.metadata.get("mode")}
    for name, literal in _MODE_LITERAL.findall(text):
        if name in modes and literal[:1].isdigit() and not literal.lower().startswith("0o"):
            raise ConfigError(
                f"invalid {modes[name]} = {literal} in {file}: a permission mode must be written "
                f'in octal, e.g. {name} = 0o660 (or "660")'
            )


# A configuration is a few KiB; its bytes are read whole (SIGHUP reads them on the event loop).
MAX_CONFIG_BYTES = 1 << 20
# How long a start waits for a pipe given as --config (``<(...)``) to be written and closed: a
# FIFO nobody writes must not hang the start.
PIPE_READ_S = 30.0


def _read_config(file: Path, *, pipe: bool = False) -> bytes:
    """The config file's bytes: a regular file (symlinks followed, as a ConfigMap's are) of at
    most MAX_CONFIG_BYTES, opened without blocking, or with ``pipe`` a pipe or FIFO
    (:func:`_read_pipe`). ConfigError otherwise: a FIFO swapped in
    for it blocked the event loop for good at the next SIGHUP (health checks timed out, SIGTERM
    went unhandled), and ``/dev/zero`` grew the daemon's memory without end."""
    fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if pipe and stat.S_ISFIFO(st.st_mode):
            data = _read_pipe(fd, file)
        elif stat.S_ISREG(st.st_mode):
            data = f.read(MAX_CONFIG_BYTES + 1)
        else:
            kinds = "a regular file or a pipe" if pipe else "a regular file"
            raise ConfigError(f"config file {file} is not {kinds}")
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {file} is larger than {MAX_CONFIG_BYTES} bytes")
    return data


def _read_pipe(fd: int, file: Path) -> bytes:
    """At most MAX_CONFIG_BYTES + 1 bytes of the pipe ``fd`` (non-blocking), until its writers
    close it; ConfigError past PIPE_READ_S. The kernel reports no hang-up on a FIFO opened
    before any writer until one has come and gone, so a FIFO nobody writes waits out the
    deadline rather than reading as an empty configuration."""
    deadline = time.monotonic() + PIPE_READ_S
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    chunks: list[bytes] = []
    size = 0
    while size <= MAX_CONFIG_BYTES:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            raise ConfigError(f"config pipe {file}: not written and closed within {PIPE_READ_S:g} s")
        try:
            chunk = os.read(fd, MAX_CONFIG_BYTES + 1 - size)
        except BlockingIOError:
            continue
        if not chunk:
            break  # every writer closed it
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def is_pipe(file: Path) -> bool:
    """Whether ``file`` names a pipe or FIFO now (False when it cannot be looked at)."""
    try:
        return stat.S_ISFIFO(os.stat(file).st_mode)
    except OSError:
        return False


def resolve(
    cli: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    file: Path | None = None,
    *,
    pipe: bool = False,
) -> Config:
    """Build the configuration: ``cli`` (dotted keys) > ``env`` > ``file`` > defaults.

    ``env`` defaults to ``os.environ``; ``file`` defaults to ``$HICACHED_CONFIG`` if set.
    ``pipe``: ``file`` may be a pipe or FIFO (``--config <(...)`` at a start: the admin's own
    choice; never ``$HICACHED_CONFIG``, nor a re-read: a pipe read once has nothing left).
    Backend tables (``[l3.redis]``, ``HICACHED_L3_REDIS_HOST``, ``--set l3.redis.host=...``)
    go through the same coercer and end as that backend's own config dataclass.
    """
    env = os.environ if env is None else env
    if file is None and env.get("HICACHED_CONFIG"):
        file = Path(env["HICACHED_CONFIG"])
        pipe = False
    layered: dict[str, dict[str, Any]] = {name: {} for name in SECTION_TYPES}
    if file is not None:
        try:
            text = _read_config(file, pipe=pipe).decode("utf-8")
            data = tomllib.loads(text)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {file}: {exc.strerror}") from exc
        except ConfigError:  # _read_config's own (not a regular file, too large): already one line
            raise
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"config file {file} is not valid UTF-8 (byte {exc.start}: {exc.reason})"
            ) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {file} is not valid TOML: {exc}") from exc
        except RecursionError:
            # tomllib recurses per nesting level; a deep file is a config error, not a crash.
            raise ConfigError(f"config file {file} is nested too deeply to be a configuration") from None
        except ValueError as exc:  # tomllib's own int(): an integer of more than 4,300 digits
            raise ConfigError(f"config file {file} is not a configuration: {str(exc)[:200]}") from None
        _check_mode_literals(text, file)
        for section, values in data.items():
            if section in SECTION_TYPES and not isinstance(values, dict):
                raise ConfigError(f"[{section}] in {file} must be a table of keys, got {clip(values)}")
            if section not in SECTION_TYPES:
                raise ConfigError(
                    f"unknown section [{clip(section)}] in {file}: expected one of {', '.join(SECTION_TYPES)}"
                )
            for dotted, value in _flatten(section, values):
                _set(layered, dotted, value, origin=str(file), text=False, once=True)
    for alias, key in ALIASES.items():
        if env_var(alias) in env and env_var(key) in env:  # which one wins would be a guess
            raise ConfigError(f"{key} is given twice: by {env_var(alias)} and by {env_var(key)}")
        if env_var(alias) in env:
            _set(layered, alias, env[env_var(alias)], origin=env_var(alias))
    for key in KEYS:
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
        sections[name] = SECTION_TYPES[name](**vals, **tables)
    cfg = Config(**sections)
    _check_cross(cfg)
    return cfg


def _build_table(section: str, table: str, default: Any, values: Mapping[str, Any]) -> Any:
    try:
        return dataclasses.replace(default, **values)
    except InvalidArgument as exc:  # the backend's own cross-checks (__post_init__)
        raise ConfigError(f"invalid [{section}.{table}]: {exc}") from exc


def _set(
    layered: dict[str, dict[str, Any]],
    dotted: str,
    value: Any,
    *,
    origin: str,
    text: bool = True,
    once: bool = False,
) -> None:
    """``once``: ConfigError if the key was set already (a file naming one key by two spellings)."""
    given, dotted = dotted, ALIASES.get(dotted, dotted)
    if dotted in _REMOVED:
        raise ConfigError(
            f"configuration key {clip(dotted)} (from {origin}) was removed: use {_REMOVED[dotted]}"
        )
    if len(dotted) > 80:  # no key is half as long: quote a prefix, not a pasted blob
        raise ConfigError(f"unknown configuration key {clip(dotted)} (from {origin})")
    entry = KEYS.get(dotted)
    if entry is None:
        section, _, rest = dotted.partition(".")
        table = rest.partition(".")[0]
        if section in SECTION_TYPES and table in _tables(section):
            scope = f"{section}.{table}."
        elif section in SECTION_TYPES:
            scope = f"{section}."
        else:
            scope = ""
        known = ", ".join(k for k in KEYS if k.startswith(scope) and k.count(".") == scope.count("."))
        raise ConfigError(
            f"unknown configuration key {clip(dotted)} (from {origin}); known: "
            + (known if scope else ", ".join(SECTION_TYPES))
        )
    f, tp = entry
    coerced = _coerce(dotted, f, value, tp, text=text)
    parts = dotted.split(".")
    where = layered[parts[0]].setdefault(parts[1], {}) if len(parts) == 3 else layered[parts[0]]
    if once and parts[-1] in where:  # two spellings of one key: which one wins would be a guess
        spellings = " and ".join(sorted({given, dotted, *(a for a, k in ALIASES.items() if k == dotted)}))
        raise ConfigError(f"{dotted} is given twice in {origin} (as {spellings}): keep one")
    where[parts[-1]] = coerced


KEYS: dict[str, tuple[dataclasses.Field[Any], Any]] = {key: (f, tp) for key, f, tp in all_keys()}
