"""The ``redis`` L3 backend: Redis or Valkey through redis-py (with hiredis).

Each page is one string value holding a frame (``hicached.l3.framing``:
header with length, key hash and XXH3 checksum, then the payload), stored
with ``SET NX`` so a present key is never rewritten. Batches go out as
pipelines of at most ``batch_pages`` commands (one round trip each); reads
use ``MGET``. A frame that fails verification is a miss and is counted, and so
is a key holding another type of value (another program's), found by one more
request for a batch with misses; both are removed so the page can be stored again.

Buffers: redis-py needs one contiguous value per page, so ``set_from`` makes
one copy (header + chunks) and ``get_into`` copies each verified payload into
the caller's chunks; there is no zero-copy path over the Redis protocol.

Thread-safety: redis-py clients draw connections from a thread-safe pool;
counters sit behind a lock. A server that cannot be reached raises
:class:`~hicached.errors.Unavailable`; a command the server refuses (e.g.
out of memory) fails only its own key.

``stats()``: ``pages`` and ``bytes`` (payload) count the values under
``key_prefix`` (SCAN, run by the daemon's L3 stats refresh, not per call);
``capacity_bytes`` (``maxmemory``, 0 = unlimited) and ``evicted_pages``
describe the whole server, which may be shared; hits, misses and corrupt
pages are this client's.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from hicached.coerce import option
from hicached.errors import InvalidArgument, Unavailable
from hicached.l3.base import BackendStats, StorageBackend, check_batch, scatter_into
from hicached.l3.framing import FRAME_HEADER, frame, unframe
from hicached.l3.registry import register_backend

if TYPE_CHECKING:
    import redis as redis_lib

__all__ = ["RedisBackend", "RedisBackendConfig"]

log = logging.getLogger(__name__)

_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


# Delete KEYS[1] only while it still holds ARGV[1] (a corrupt value; a new write may have
# replaced it meanwhile).
_DELETE_IF_SAME = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
)
# Delete each of KEYS that holds a value other than a string (another program's hash, list, ...);
# per key 1 if deleted. MGET answers nil for such a key, as for a missing one, while EXISTS finds
# it and SET NX keeps failing on it (answered as "already present").
_DELETE_IF_NOT_STRING = """
local dropped = {}
for i, key in ipairs(KEYS) do
  local kind = redis.call('TYPE', key)['ok']
  dropped[i] = 0
  if kind ~= 'string' and kind ~= 'none' then
    redis.call('DEL', key)
    dropped[i] = 1
  end
end
return dropped
"""


@dataclasses.dataclass(frozen=True)
class RedisBackendConfig:
    """Options of the ``redis`` backend.

    ``unix_socket`` overrides ``host``/``port``. ``key_prefix`` is prepended
    to every key (lets several daemons share one database). ``ttl_s``: expiry
    of each page in seconds, 0 = never. ``batch_pages``: commands per pipeline.
    ``retries``: reconnect attempts (short exponential backoff) before a
    command fails as unavailable.
    """

    host: str = option("127.0.0.1", help="Redis/Valkey server host.")
    port: int = option(6379, help="Redis/Valkey server port.")
    db: int = option(0, help="Database number.")
    username: str | None = option(None, help="ACL user name (unset = default user).")
    password: str | None = option(None, help="Password (unset = none).")
    unix_socket: str | None = option(None, help="Unix socket path; overrides host and port.")
    key_prefix: str = option("", help="Prepended to every key (several daemons can share a database).")
    socket_timeout_s: float = option(5.0, help="Connect and command timeout in seconds.")
    ttl_s: int = option(0, help="Expiry of each page in seconds (0 = never).")
    batch_pages: int = option(128, help="Commands per pipeline.")
    retries: int = option(2, help="Reconnect attempts before a command fails as unavailable.")

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise InvalidArgument(f"redis backend option 'port' must be in 1..65535, got {self.port}")
        if self.db < 0:
            raise InvalidArgument(f"redis backend option 'db' must be >= 0, got {self.db}")
        if self.socket_timeout_s <= 0:
            raise InvalidArgument(
                f"redis backend option 'socket_timeout_s' must be > 0, got {self.socket_timeout_s}"
            )
        if self.ttl_s < 0:
            raise InvalidArgument(f"redis backend option 'ttl_s' must be >= 0, got {self.ttl_s}")
        if self.retries < 0:
            raise InvalidArgument(f"redis backend option 'retries' must be >= 0, got {self.retries}")
        if self.batch_pages <= 0:
            raise InvalidArgument(f"redis backend option 'batch_pages' must be > 0, got {self.batch_pages}")


def _import_redis() -> Any:
    try:
        import redis
    except ModuleNotFoundError:
        raise InvalidArgument(
            "storage backend 'redis' needs the redis client: pip install 'hicached[redis]'"
        ) from None
    return redis


@register_backend("redis", RedisBackendConfig)
class RedisBackend(StorageBackend):
    """Pages as framed string values in Redis/Valkey; see the module docstring."""

    name = "redis"

    def __init__(self, config: RedisBackendConfig) -> None:
        self.config = config
        self._redis = _import_redis()
        from redis.backoff import ExponentialBackoff
        from redis.retry import Retry

        kwargs: dict[str, Any] = {
            "retry": Retry(ExponentialBackoff(cap=0.5, base=0.01), config.retries),
            "db": config.db,
            "username": config.username,
            "password": config.password,
            "socket_timeout": config.socket_timeout_s,
            "socket_connect_timeout": config.socket_timeout_s,
        }
        if config.unix_socket:
            kwargs["unix_socket_path"] = config.unix_socket
        else:
            kwargs["host"] = config.host
            kwargs["port"] = config.port
        self._client: redis_lib.Redis = self._redis.Redis(**kwargs)
        self._lock = threading.Lock()
        self._hits = self._misses = self._corrupt = 0
        self._closed = False
        self._call(self._client.ping)

    def _where(self) -> str:
        c = self.config
        return c.unix_socket or f"{c.host}:{c.port}"

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise Unavailable(f"redis backend for {self._where()} is closed")
        try:
            return fn(*args, **kwargs)
        except (self._redis.ConnectionError, self._redis.TimeoutError) as exc:
            raise Unavailable(f"redis server at {self._where()} is unreachable: {exc}") from exc
        except self._redis.RedisError as exc:  # e.g. a replica read-only during a failover
            raise Unavailable(
                f"redis server at {self._where()} refused: {type(exc).__name__}: {exc}"
            ) from exc

    def _batches(self, n: int) -> Iterator[range]:
        step = self.config.batch_pages
        for start in range(0, n, step):
            yield range(start, min(start + step, n))

    def _full(self, key: str) -> str:
        return self.config.key_prefix + key

    # ------------------------------------------------------------------ reads

    def exists(self, keys: Sequence[str]) -> int:
        check_batch(keys, keys, "keys")
        count = 0
        for batch in self._batches(len(keys)):
            pipe = self._client.pipeline(transaction=False)
            for i in batch:
                pipe.exists(self._full(keys[i]))
            for present in self._call(pipe.execute):
                if not present:
                    return count
                count += 1
        return count

    def present(self, keys: Sequence[str]) -> list[bool]:
        check_batch(keys, keys, "keys")
        out: list[bool] = []
        for batch in self._batches(len(keys)):
            pipe = self._client.pipeline(transaction=False)
            for i in batch:
                pipe.exists(self._full(keys[i]))
            out.extend(bool(found) for found in self._call(pipe.execute))
        return out

    def _drop_wrong_types(self, keys: Sequence[str]) -> int:
        """Remove the values of ``keys`` (MGET found none) that are not strings; how many. One
        request, only for batches with a miss. A failure is logged: still misses, tried again
        at the next read."""
        try:
            dropped = self._call(
                self._client.eval, _DELETE_IF_NOT_STRING, len(keys), *[self._full(k) for k in keys]
            )
        except Unavailable as exc:
            log.warning("redis backend: could not check %d missing pages' types: %s", len(keys), exc)
            return 0
        for key, flag in zip(keys, dropped, strict=True):
            if flag:
                log.warning("redis backend: page %r held a value that is not a string; removed it", key)
        return sum(int(flag) for flag in dropped)

    def _fetch(self, keys: Sequence[str]) -> list[memoryview | None]:
        """The verified payloads (None: a miss). A value that fails verification, or is not a
        string, is removed (the former only if it still holds those bytes): a later set (NX) of
        the key could not replace it otherwise."""
        out: list[memoryview | None] = []
        corrupt = 0
        for batch in self._batches(len(keys)):
            blobs = self._call(self._client.mget, [self._full(keys[i]) for i in batch])
            missing = [keys[i] for i, blob in zip(batch, blobs, strict=True) if blob is None]
            if missing:
                corrupt += self._drop_wrong_types(missing)
            for i, blob in zip(batch, blobs, strict=True):
                payload = None if blob is None else unframe(keys[i], blob)
                if blob is not None and payload is None:
                    corrupt += 1
                    log.warning("redis backend: page %r failed verification; removing it", keys[i])
                    try:
                        self._call(self._client.eval, _DELETE_IF_SAME, 1, self._full(keys[i]), blob)
                    except Unavailable as exc:  # still a miss; the next read tries again
                        log.warning("redis backend: could not remove page %r: %s", keys[i], exc)
                out.append(payload)
        with self._lock:
            self._corrupt += corrupt
        return out

    def _count(self, ok: Sequence[bool]) -> None:
        hits = sum(ok)
        with self._lock:
            self._hits += hits
            self._misses += len(ok) - hits

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        check_batch(keys, keys, "keys")
        pages = [None if p is None else p.tobytes() for p in self._fetch(keys)]
        self._count([p is not None for p in pages])
        return pages

    def get_into(self, keys: Sequence[str], dests: Sequence[Sequence[memoryview]]) -> list[bool]:
        check_batch(keys, dests, "destinations")
        ok = [scatter_into(payload, chunks) for payload, chunks in zip(self._fetch(keys), dests, strict=True)]
        self._count(ok)  # a destination of another size is a miss, as in the other backends
        return ok

    # ----------------------------------------------------------------- writes

    def _store(self, keys: Sequence[str], frames: Sequence[bytes]) -> list[bool]:
        results: list[bool] = []
        ex = self.config.ttl_s or None
        for batch in self._batches(len(keys)):
            pipe = self._client.pipeline(transaction=False)
            for i in batch:
                pipe.set(self._full(keys[i]), frames[i], nx=True, ex=ex)
            for i, reply in zip(batch, self._call(pipe.execute, raise_on_error=False), strict=True):
                if isinstance(reply, Exception):
                    log.warning("redis backend: SET %r refused: %s", keys[i], reply)
                    results.append(False)
                else:  # True: stored; None: already present (NX), also a success
                    results.append(True)
        return results

    def set(self, keys: Sequence[str], values: Sequence[bytes | memoryview]) -> list[bool]:
        check_batch(keys, values, "values")
        return self._store(keys, [frame(key, [value]) for key, value in zip(keys, values, strict=True)])

    def set_from(self, keys: Sequence[str], srcs: Sequence[Sequence[memoryview]]) -> list[bool]:
        check_batch(keys, srcs, "sources")
        return self._store(keys, [frame(key, chunks) for key, chunks in zip(keys, srcs, strict=True)])

    # ------------------------------------------------------------- management

    def delete(self, keys: Sequence[str]) -> int:
        check_batch(keys, keys, "keys")
        unique = list(dict.fromkeys(keys))
        removed = 0
        for batch in self._batches(len(unique)):
            removed += int(self._call(self._client.delete, *[self._full(unique[i]) for i in batch]))
        return removed

    def clear(self, prefix: str = "") -> int:
        pattern = _GLOB_SPECIAL.sub(r"\\\1", self._full(prefix)) + "*"
        removed = 0
        cursor = 0
        while True:
            cursor, names = self._call(self._client.scan, cursor, match=pattern, count=1000)
            if names:
                removed += int(self._call(self._client.delete, *names))
            if not cursor:
                return removed

    def _ours(self) -> tuple[int, int]:
        """Pages and payload bytes under ``key_prefix``: SCAN, and STRLEN of each batch in
        one pipeline. The database may hold other daemons' pages (other prefixes), and a value
        under ours that is not a string (another program's) is not a page: STRLEN refuses it,
        and that refusal must not fail every stats refresh."""
        pattern = _GLOB_SPECIAL.sub(r"\\\1", self._full("")) + "*"
        pages = payload = 0
        cursor = 0
        while True:
            cursor, names = self._call(self._client.scan, cursor, match=pattern, count=1000)
            if names:
                pipe = self._client.pipeline(transaction=False)
                for name in names:
                    pipe.strlen(name)
                sizes = [n for n in self._call(pipe.execute, raise_on_error=False) if isinstance(n, int)]
                pages += len(sizes)
                payload += sum(max(0, n - FRAME_HEADER.size) for n in sizes)
            if not cursor:
                return pages, payload

    def stats(self) -> BackendStats:
        info = self._call(self._client.info)
        pages, payload = self._ours()
        with self._lock:
            return BackendStats(
                pages=pages,
                bytes=payload,
                capacity_bytes=int(info.get("maxmemory", 0)),
                hits=self._hits,
                misses=self._misses,
                corrupt_pages=self._corrupt,
                evicted_pages=int(info.get("evicted_keys", 0)),
            )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._client.close()
