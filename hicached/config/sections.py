"""The configuration's sections: one frozen dataclass per ``[section]`` of the TOML file.

Each field's ``metadata["help"]`` documents it (``describe()`` renders the table); a
section's defaults are the daemon's. The L3 backends' tables (``[l3.file]``, ...) are
each backend's own config dataclass (``hicached/l3/<backend>.py``). Immutable, so
thread-safe.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from hicached.coerce import format_tenant_uids, one_of, parse_size, parse_tenant_uids, typed_fields
from hicached.errors import InvalidArgument
from hicached.l3.file import FileBackendConfig
from hicached.l3.mooncake import MooncakeBackendConfig
from hicached.l3.redis import RedisBackendConfig
from hicached.l3.registry import L3Backend
from hicached.l3.s3 import S3BackendConfig
from hicached.policies import PrefetchPolicy, WritePolicy

__all__ = [
    "SECTION_TYPES",
    "Config",
    "ConfigError",
    "CopyConfig",
    "HostConfig",
    "L3Config",
    "LimitsConfig",
    "LogConfig",
    "LogFormat",
    "LogLevel",
    "ServerConfig",
    "SessionConfig",
    "available_memory_bytes",
    "default_cache_dir",
]


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
    default: Any,
    help: str,
    *,
    parse: Callable[[Any], Any] | None = None,
    mode: bool = False,
    expect: str = "",
    show: Callable[[Any], str] | None = None,
    **kw: Any,
) -> Any:
    meta: dict[str, Any] = {"help": help}
    if parse is not None:
        meta["parse"] = parse
    if expect:
        meta["expect"] = expect  # what a custom parser takes, for errors
    if show is not None:
        meta["show"] = show  # how the parsed value is written back as text
    if mode:
        meta["mode"] = True  # octal permission bits: text is octal, written back as 0o660
    if callable(default) and not isinstance(default, type):
        return field(default_factory=default, metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


class _Section:
    """A config dataclass whose fields go through the one coercer when built: a config made in
    Python (``L3Config(backend="none")``) is checked and typed as a file's values are."""

    _key: ClassVar[str]  # the section's name in the file ("" for the whole Config)

    def __post_init__(self) -> None:
        try:
            typed_fields(self, self._key)
        except InvalidArgument as exc:
            raise ConfigError(str(exc)) from None


@dataclass(frozen=True)
class ServerConfig(_Section):
    _key: ClassVar[str] = "server"
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
    max_connections: int = _f(
        1024, "Connections each gRPC listener (worker socket, admin socket, TCP) accepts at once."
    )
    max_streams_per_connection: int = _f(
        64, "Calls one gRPC connection may have open at once (more wait in the client)."
    )
    max_health_watchers: int = _f(
        64,
        "Health Watch streams each gRPC listener keeps open at once (more are RESOURCE_EXHAUSTED; "
        "Check is not counted).",
    )
    idle_connection_s: float = _f(
        300.0,
        "A gRPC connection with no call for this long is closed (clients reconnect on their next call).",
    )
    keepalive_s: float = _f(
        60.0,
        "Ping each gRPC connection this often; a peer that does not answer within 20 s is dropped "
        "with the answers it left unread.",
    )
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
    handoff_max_pending_fds_per_uid: int = _f(
        256, "Most file descriptors one client uid's unused fd handoff tickets may hold."
    )
    fast_lane: bool = _f(
        True,
        "Serve the fast lane (<socket>.lane: shared-memory rings for Write, Load, Resolve, Release and "
        "GetPages/PutPages/Lookup by given keys; see docs/fastlane.md).",
    )
    fast_lane_max: int = _f(64, "Most fast lanes (open or negotiating) in total; each holds one thread.")
    fast_lane_max_per_session: int = _f(4, "Most open fast lanes per session.")
    fast_lane_max_per_uid: int = _f(16, "Most fast lanes (open or negotiating) per client uid (SO_PEERCRED).")
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
class HostConfig(_Section):
    _key: ClassVar[str] = "host"
    budget: int = _f(
        0,
        "Node-wide host (L2) memory budget in bytes: the pools' segments plus the daemon's "
        "bookkeeping per page (docs/limits.md); 0 = budget_fraction.",
        parse=parse_size,
    )
    budget_fraction: float = _f(
        0.25, "Budget as a fraction of available memory (cgroup-aware) when budget=0."
    )
    default_ratio: float = _f(
        2.0, "Host pool size as a multiple of the device pool when a pool asks for none."
    )
    shm_prefix: str = _f("hicached", "Prefix of the daemon's shared-memory segment names.")
    prefault: bool = _f(True, "Prefault host pools at creation (first touch is ~8x slower than a warm copy).")
    max_groups: int = _f(
        64,
        "Most pool groups (one per model and pool layout) at once; a new one retires the least "
        "recently used idle group, else RESOURCE_EXHAUSTED. Each costs a descriptor and memory maps.",
    )
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
class SessionConfig(_Section):
    _key: ClassVar[str] = "sessions"
    lease_ms: int = _f(10_000, "Default session lease; a session missing heartbeats this long is ended.")
    min_lease_ms: int = _f(500, "Smallest lease a worker may ask for.")
    max_lease_ms: int = _f(300_000, "Largest lease a worker may ask for.")
    retraction_lease_ms: int = _f(60_000, "Default time a retraction backup is guaranteed resident.")
    op_cache_size: int = _f(4096, "Operation ids remembered per session for idempotent retries.")
    op_cache_bytes: int = _f(
        4 << 20, "Bytes of remembered answers per session for idempotent retries (LRU).", parse=parse_size
    )
    tenant_uids: Mapping[str, frozenset[int]] = _f(
        lambda: parse_tenant_uids(""),
        "Tenants reserved for client uids, e.g. team-a=1000,1001;team-b=1002: an Attach naming a listed "
        "tenant must come from one of its uids (or root; the fd handoff's SO_PEERCRED), else "
        "PERMISSION_DENIED. Tenants not listed are open to every worker.",
        parse=parse_tenant_uids,
        expect="TENANT=UID[,UID...] entries separated by ; (in Python: a mapping of tenant to uids)",
        show=format_tenant_uids,
    )


@dataclass(frozen=True)
class CopyConfig(_Section):
    _key: ClassVar[str] = "copy"
    workers: int = _f(2, "Copy engine worker threads (node-wide).")
    max_queued: int = _f(
        1 << 30, "Bytes of copies that may wait before RESOURCE_EXHAUSTED.", parse=parse_size
    )


def _default_file_backend() -> FileBackendConfig:
    return FileBackendConfig(path=str(default_cache_dir() / "l3"))


# Each backend's table ([l3.file], [l3.redis], ...) is that backend's own config dataclass;
# the daemon's defaults for the options a backend requires are given here.
_BACKEND_HELP = "Options of the {} backend (table [l3.{}]; see the l3.{}.* keys)."


@dataclass(frozen=True)
class L3Config(_Section):
    _key: ClassVar[str] = "l3"
    backend: L3Backend = _f(L3Backend.FILE, f"Storage backend: {one_of(L3Backend)}.")
    write_policy: WritePolicy = _f(
        WritePolicy.WRITE_THROUGH, f"When an L2 page is backed up to L3: {one_of(WritePolicy)}."
    )
    prefetch_policy: PrefetchPolicy = _f(
        PrefetchPolicy.BEST_EFFORT, f"Prefetch policy of a request that names none: {one_of(PrefetchPolicy)}."
    )
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
    auth_key_file: str = _f(
        "",
        "File holding a secret of at least 32 bytes (read at start; trailing newlines are not part of "
        "it): the redis, s3 and mooncake backends write and serve only frames carrying an HMAC of key "
        "and payload under it, and tenant tags are keyed by it. The same file on every daemon sharing "
        "the L3. Empty = none: every writer of a shared L3 is trusted with every tenant's pages "
        "(docs/deploy.md).",
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
        return None if self.backend is L3Backend.NONE else getattr(self, self.backend)


@dataclass(frozen=True)
class LimitsConfig(_Section):
    """Per-request and per-peer limits, checked before any work starts (see docs/limits.md)."""

    _key: ClassVar[str] = "limits"

    max_tokens_per_request: int = _f(1 << 20, "Most token ids one KeySource.tokens chain may carry.")
    max_keys_per_request: int = _f(1 << 16, "Most keys one request may carry (given or hashed from tokens).")
    max_key_bytes: int = _f(512, "Longest key (UTF-8 bytes).")
    max_identity_bytes: int = _f(
        256, "Longest identity string (instance_id, model_name, tenant, op_id, request_id; UTF-8 bytes)."
    )
    max_request_bytes: int = _f(
        8 << 20,
        "Largest request the daemon parses, PutBytes excepted (bytes; capped by "
        "server.max_message_bytes): checked before parsing, which runs on the event loop.",
        parse=parse_size,
    )
    max_response_bytes: int = _f(
        32 << 20,
        "Largest response a request may ask for, computed before it is built (capped by "
        "server.max_message_bytes).",
        parse=parse_size,
    )
    max_unread_answer_bytes_per_peer: int = _f(
        256 << 20,
        "Bytes of answers (GetBytes; a Lookup's derived keys and per-key flags, counted 3 times) one "
        "peer may have built and not yet read (held until its clients read them or the connection "
        "drops); a call over it is RESOURCE_EXHAUSTED, unless the peer holds none.",
        parse=parse_size,
    )
    max_request_bytes_held_per_peer: int = _f(
        1 << 30,
        "Bytes of requests (their size on the wire; those of 64 KiB or more that name a session) one "
        "peer's calls may hold at once, parsed and not yet answered (calls waiting for a lane hold "
        "theirs); a call over it is RESOURCE_EXHAUSTED with a retry hint, unless the peer holds none.",
        parse=parse_size,
    )
    max_sessions_per_peer: int = _f(
        256, "Most live sessions of one peer (the handoff's SO_PEERCRED uid, the TCP host, or the socket)."
    )
    max_buffers_per_attach: int = _f(
        512, "Most device buffers (K and V of every pool) one Attach may hand over."
    )
    max_buffer_bytes_per_peer: int = _f(
        1 << 40,
        "Most bytes of memfd device buffers (fd handoff; as their shapes declare) the live sessions "
        "of one peer may have handed over together: the daemon maps what they declare, so this "
        "bounds the address space one peer can take. CUDA buffers are not counted.",
        parse=parse_size,
    )
    max_mappings_per_peer: int = _f(
        4096,
        "Most mappings of memfd device buffers (one per run of an fd's buffers under 1 MiB apart) the live "
        "sessions of one peer may hold: each is one of the daemon's vm.max_map_count (65530) areas.",
    )
    max_pools_per_attach: int = _f(
        32,
        "Most pools (byte-only ones included) one Attach may declare, and so the most transfers one "
        "request may carry (each pool at most once).",
    )
    max_layers_per_pool: int = _f(4096, "Most layers (num_layers) of one pool of an Attach.")
    max_l3_calls_queued: int = _f(
        64, "RPCs that may wait for an L3 thread (server.l3_threads) before RESOURCE_EXHAUSTED."
    )
    max_copy_calls_per_session: int = _f(
        8,
        "RPCs of one session that may run or wait on the copy lane at once (the copy engine is fair "
        "between sessions, so the rest of server.copy_threads must stay free for others).",
    )
    max_l3_calls_per_session: int = _f(
        4,
        "RPCs of one session that may run or wait on the L3 lane at once (its blocking waits must "
        "leave server.l3_threads for other sessions).",
    )
    max_hash_calls_queued: int = _f(
        16,
        "RPCs that may wait for a hash thread (server.hash_threads: token hashing, checks of many "
        "given keys) before RESOURCE_EXHAUSTED; each holds its request, up to server.max_message_bytes.",
    )
    max_hash_calls_per_session: int = _f(
        2, "RPCs of one session that may run or wait on the hash lane at once."
    )
    max_alloc_calls_per_session: int = _f(
        4,
        "RPCs of one session that may run or wait on the alloc lane at once (Alloc and ResolveTransfers "
        "of more than 1 MiB of host pages); each holds its request until it runs.",
    )
    max_prefetches_per_session: int = _f(
        16, "Prefetches one session may have running or queued at once; one more is RESOURCE_EXHAUSTED."
    )
    max_prefetch_keys_per_peer: int = _f(
        1 << 20, "Keys the plans of one peer's running or queued prefetches hold together (each ~150 bytes)."
    )
    max_wait_s: float = _f(
        30.0,
        "Deadline of a blocking wait (Backup wait, PrefetchStatus wait, the wait at session end): "
        "past it the call answers the state so far.",
    )


class LogLevel(enum.StrEnum):
    """``log.level``: the least severe records written."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class LogFormat(enum.StrEnum):
    """``log.format``: how each record is written (hicached.logs)."""

    TEXT = "text"
    JSON = "json"


@dataclass(frozen=True)
class LogConfig(_Section):
    _key: ClassVar[str] = "log"
    level: LogLevel = _f(LogLevel.INFO, f"{one_of(LogLevel)}.")
    format: LogFormat = _f(
        LogFormat.TEXT,
        (
            'text (one line per record: message, then key=value; a value with a space, =, ", \\ or a '
            "non-printable character is a JSON string, any value is cut at 200 characters; a traceback "
            "follows on indented lines) or json (one JSON object per line)."
        ),
    )
    max_rate: float = _f(
        20.0,
        "Most lines per second each logging call site writes below ERROR (and gRPC's own at "
        "ERROR), after a burst of 10 s worth (clients cause lines: each attach and detach writes "
        "one); the rest are dropped and "
        "the site's next line says how many (dropped=N). 0: no limit.",
    )


@dataclass(frozen=True)
class Config(_Section):
    _key: ClassVar[str] = ""
    server: ServerConfig = field(default_factory=ServerConfig)
    host: HostConfig = field(default_factory=HostConfig)
    sessions: SessionConfig = field(default_factory=SessionConfig)
    copy: CopyConfig = field(default_factory=CopyConfig)
    l3: L3Config = field(default_factory=L3Config)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    log: LogConfig = field(default_factory=LogConfig)


SECTION_TYPES: dict[str, type[Any]] = {
    "server": ServerConfig,
    "host": HostConfig,
    "sessions": SessionConfig,
    "copy": CopyConfig,
    "l3": L3Config,
    "limits": LimitsConfig,
    "log": LogConfig,
}
