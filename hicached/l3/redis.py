"""The ``redis`` L3 backend: Redis or Valkey through redis-py (with hiredis).

Each page is one string value holding a frame (``hicached.l3.framing``:
header with length and the key's and payload's XXH3, or with ``l3.auth_key_file``
an HMAC of key and payload, then the payload), stored with ``SET NX`` so a
present key is never rewritten. Batches go out as
pipelines of at most ``batch_pages`` commands (one round trip each). Reads are
``GETRANGE`` of at most one byte past the largest value the reader can take (the
frame of its destination for ``get_into``, ``max_value_bytes`` for ``get``): the
database is shared, and a value someone else stored under a page's name may be
of any size, so the server never sends the daemon more than that. A frame that
fails verification is a miss and is counted, and so is a value of another size
than the frame asked for, of another type (another program's hash, list, ...)
or an empty string; all are removed so the page can be stored again (a frame
that fails verification by a request of its own, the others by one request
for a batch with such a value or a miss).

Trust. With plain frames (the default ``codec``) every writer of the database
can store a valid frame of any bytes under any page's name: it is trusted with
every page. With an authenticated codec (the daemon's ``l3.auth_key_file``)
only a holder of the secret can: a frame without a valid MAC, a plain one
included, fails verification like a corrupt one (a counted miss, removed).

Buffers: redis-py needs one contiguous value per page, so ``set_from`` makes
one copy (header + chunks) and ``get_into`` copies each verified payload into
the caller's chunks; there is no zero-copy path over the Redis protocol. One
batch holds at most ``batch_pages`` x (its largest frame + 1) bytes read.

Thread-safety: redis-py clients draw connections from a thread-safe pool;
the read counters (:class:`~hicached.l3.base.ReadCounters`) lock their own. A server that cannot be reached raises
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
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from hicached.coerce import option, parse_size, typed_fields
from hicached.errors import NO_RETRY, InvalidArgument, Unavailable, clip
from hicached.l3.base import (
    BackendStats,
    ReadCounters,
    StorageBackend,
    check_batch,
    chunks_nbytes,
    scatter_into,
)
from hicached.l3.framing import FRAME_HEADER, PLAIN, FrameCodec
from hicached.l3.registry import L3Backend, register_backend

if TYPE_CHECKING:
    import redis as redis_lib

__all__ = ["RedisBackend", "RedisBackendConfig"]

log = logging.getLogger(__name__)

_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


# Redis's default proto-max-bulk-len: the longest string a server stores unless configured
# otherwise, so the default bound refuses no page such a server would have taken.
MAX_VALUE_BYTES = 512 << 20

# Delete KEYS[1] only while it still holds ARGV[1] (a corrupt value; a new write may have
# replaced it meanwhile).
_DELETE_IF_SAME = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
)
# Delete each of KEYS that holds no page: a value of another type (another program's hash, list,
# ...), or a string shorter than ARGV[2i-1] or longer than ARGV[2i] bytes; per key 1 if deleted.
# Such a value is a miss on every read while EXISTS finds it and SET NX keeps failing on it
# (answered as "already present"), so it would stay a permanent miss. The type and size are
# checked here again: a page stored since the read (after a delete) stays.
_DELETE_IF_NOT_PAGE = """
local dropped = {}
for i, key in ipairs(KEYS) do
  local kind = redis.call('TYPE', key)['ok']
  dropped[i] = 0
  if kind ~= 'none' then
    local n = -1
    if kind == 'string' then n = redis.call('STRLEN', key) end
    if n < tonumber(ARGV[2 * i - 1]) or n > tonumber(ARGV[2 * i]) then
      redis.call('DEL', key)
      dropped[i] = 1
    end
  end
end
return dropped
"""
# Reads: GETRANGE 0..high per key, pipelined, rather than MGET, which sends every value whole
# (64 MiB under a 4 KiB page's name arrived whole before the frame check refused it). A script
# (EVALSHA) that returns a value only when its STRLEN fits is also bounded, but copies each value
# into Lua and back. 128 pages, local redis-server 7.0, 2 cores; medians of 21 rounds, the three
# interleaved in one run (two runs):
#   64 KiB pages: MGET 5.6 / 8.1 ms, GETRANGE 6.7 / 9.2 ms (+19% / +14%), script 17.4 / 19.4 ms
#   1 MiB pages:  MGET 207 / 185 ms, GETRANGE 206 / 189 ms (+0% / +2%),   script 372 / 354 ms
# The pipeline costs ~1 ms per batch of 128 commands (parsed on both sides), not per byte;
# get_into as a whole (with the checksum and the copy out) came to +10% / +18% at 64 KiB.


@dataclasses.dataclass(frozen=True)
class RedisBackendConfig:
    """Options of the ``redis`` backend.

    ``unix_socket`` overrides ``host``/``port``. ``key_prefix`` is prepended
    to every key (lets several daemons share one database). ``ttl_s``: expiry
    of each page in seconds, 0 = never. ``batch_pages``: commands per pipeline.
    ``retries``: reconnect attempts (short exponential backoff) before a
    command fails as unavailable. ``max_value_bytes``: the largest frame the
    backend writes, so the most ``get`` reads of one value (``get_into`` reads
    at most its destination's frame); the default is Redis's own default limit
    on a string (``proto-max-bulk-len``, 512 MiB).
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
    max_value_bytes: int = option(
        MAX_VALUE_BYTES,
        help="Largest value (page + frame header: 32 bytes, 48 with l3.auth_key_file) stored, or read "
        "whole for a page of unknown size; "
        "a larger page is not stored, a larger value found is a corrupt miss, never read whole.",
        parse=parse_size,
    )
    retries: int = option(2, help="Reconnect attempts before a command fails as unavailable.")

    def target(self) -> str:
        """Where the pages are, for the startup line and errors."""
        return f"unix:{self.unix_socket}" if self.unix_socket else f"{self.host}:{self.port}/{self.db}"

    def __post_init__(self) -> None:
        typed_fields(self, "l3.redis")  # a config built in Python is checked as a file's
        if not 0 < self.port < 65536:
            raise InvalidArgument(f"redis backend option 'port' must be in 1..65535, got {clip(self.port)}")
        if self.db < 0:
            raise InvalidArgument(f"redis backend option 'db' must be >= 0, got {clip(self.db)}")
        if self.socket_timeout_s <= 0:
            raise InvalidArgument(
                f"redis backend option 'socket_timeout_s' must be > 0, got {clip(self.socket_timeout_s)}"
            )
        if self.ttl_s < 0:
            raise InvalidArgument(f"redis backend option 'ttl_s' must be >= 0, got {clip(self.ttl_s)}")
        if self.retries < 0:
            raise InvalidArgument(f"redis backend option 'retries' must be >= 0, got {clip(self.retries)}")
        if self.batch_pages <= 0:
            raise InvalidArgument(
                f"redis backend option 'batch_pages' must be > 0, got {clip(self.batch_pages)}"
            )
        if self.max_value_bytes < FRAME_HEADER.size:
            raise InvalidArgument(
                f"redis backend option 'max_value_bytes' must be >= {FRAME_HEADER.size} (a frame's "
                f"header), got {clip(self.max_value_bytes)}"
            )


def _import_redis() -> Any:
    try:
        import redis
    except ModuleNotFoundError:
        raise InvalidArgument(
            "storage backend 'redis' needs the redis client: pip install 'hicached[redis]'"
        ) from None
    return redis


@register_backend(
    L3Backend.REDIS,
    RedisBackendConfig,
    framed=True,
    fix_keys="l3.redis.host/l3.redis.port (or l3.redis.unix_socket; l3.redis.password for a login)",
)
class RedisBackend(StorageBackend):
    """Pages as framed string values in Redis/Valkey; see the module docstring."""

    name = "redis"

    def __init__(self, config: RedisBackendConfig, *, codec: FrameCodec = PLAIN) -> None:
        self.config = config
        self._codec = codec
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
        self._reads = ReadCounters()
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
        except self._redis.AuthenticationError as exc:  # a ConnectionError to redis-py: not "unreachable"
            raise Unavailable(
                f"redis server at {self._where()} refused the login ({exc}): check l3.redis.password "
                "(and l3.redis.username for an ACL user)",
                retry_after_ms=NO_RETRY,
            ) from exc
        except (self._redis.ConnectionError, self._redis.TimeoutError) as exc:
            # Not retried by the client's channel: each retry would wait the socket timeout again.
            raise Unavailable(
                f"redis server at {self._where()} is unreachable: {exc}", retry_after_ms=NO_RETRY
            ) from exc
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

    def _drop_not_pages(self, keys: Sequence[str], bounds: Sequence[tuple[int, int]]) -> list[bool]:
        """Remove the values of ``keys`` that are not pages: another type of value, or a string
        outside its ``bounds`` (least, most bytes); per key whether removed. One request, only
        for batches with such a key or a miss. A failure is logged: still misses, tried again at
        the next read."""
        args = [str(n) for pair in bounds for n in pair]
        try:
            dropped = self._call(
                self._client.eval, _DELETE_IF_NOT_PAGE, len(keys), *[self._full(k) for k in keys], *args
            )
        except Unavailable as exc:
            log.warning("redis backend: could not check %d missing or bad pages: %s", len(keys), exc)
            return [False] * len(keys)
        return [bool(flag) for flag in dropped]

    def _read(self, batch: Sequence[str], highs: Sequence[int]) -> list[Any]:
        """Per key of ``batch``, at most its first ``highs[i] + 1`` bytes (``b""``: missing, or
        an empty string), or the server's WRONGTYPE refusal (another type of value); any other
        refusal fails the batch as :class:`~hicached.errors.Unavailable`, as in :meth:`_call`."""
        pipe = self._client.pipeline(transaction=False)
        for key, high in zip(batch, highs, strict=True):
            pipe.getrange(self._full(key), 0, high)  # both ends included: high + 1 bytes
        replies: list[Any] = self._call(pipe.execute, raise_on_error=False)
        for reply in replies:
            if isinstance(reply, Exception) and not str(reply).startswith("WRONGTYPE"):
                raise Unavailable(
                    f"redis server at {self._where()} refused: {type(reply).__name__}: {reply}"
                ) from reply
        return replies

    def _fetch(self, keys: Sequence[str], frames: Sequence[int] | None) -> list[memoryview | None]:
        """The verified payloads (None: a miss). ``frames``: the exact frame size of each key
        (its destination's, for ``get_into``); None: any size up to ``max_value_bytes``. No
        more than one byte past that is read of any value. A value that fails verification, is
        of another size, is not a string, or is empty is removed (the first only if it still
        holds those bytes, the others only while still not a page): a later set (NX) of the key
        could not replace it otherwise."""
        out: list[memoryview | None] = []
        corrupt = 0
        most = self.config.max_value_bytes
        least = self._codec.header_size
        for batch in self._batches(len(keys)):
            names = [keys[i] for i in batch]
            bounds = [(frames[i], frames[i]) if frames is not None else (least, most) for i in batch]
            replies = self._read(names, [high for _low, high in bounds])
            bad: list[int] = []  # positions in the batch for _drop_not_pages
            counted: set[int] = set()  # of those, the strings of a size no page of theirs has
            for pos, (key, blob, (low, high)) in enumerate(zip(names, replies, bounds, strict=True)):
                payload = None
                if isinstance(blob, Exception) or not blob:  # another type; missing or empty
                    bad.append(pos)
                elif not low <= len(blob) <= high:
                    corrupt += 1
                    counted.add(pos)
                    bad.append(pos)
                    size = f"over {high}" if len(blob) > high else f"{len(blob)}, under {low}"
                    # The usual cause of a wrong size: a daemon with the other l3.auth_key_file
                    # setting wrote it (its header differs in size); say so when the header shows it.
                    foreign = self._codec.foreign(blob)
                    log.warning(
                        "redis backend: page %r failed verification (%s bytes%s); removing it",
                        key,
                        size,
                        f"; {foreign}" if foreign else "",
                    )
                else:
                    payload, why = self._codec.verify(key, blob)
                    if payload is None:
                        corrupt += 1
                        log.warning("redis backend: page %r failed verification (%s); removing it", key, why)
                        try:
                            self._call(self._client.eval, _DELETE_IF_SAME, 1, self._full(key), blob)
                        except Unavailable as exc:  # still a miss; the next read tries again
                            log.warning("redis backend: could not remove page %r: %s", key, exc)
                out.append(payload)
            if bad:
                dropped = self._drop_not_pages([names[p] for p in bad], [bounds[p] for p in bad])
                for pos, gone in zip(bad, dropped, strict=True):
                    if gone and pos not in counted:  # a wrong size was counted and logged above
                        corrupt += 1
                        log.warning(
                            "redis backend: page %r held a value that is not a page (another type, or "
                            "an empty string); removed it",
                            names[pos],
                        )
        self._reads.corrupt(corrupt)
        return out

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Whole pages; a value over ``max_value_bytes`` is a corrupt miss, read no further than
        one byte past that. Thread-safe; the pages returned are new bytes the caller owns."""
        check_batch(keys, keys, "keys")
        pages = [None if p is None else p.tobytes() for p in self._fetch(keys, None)]
        self._reads.count([p is not None for p in pages])
        return pages

    def get_into(self, keys: Sequence[str], dests: Sequence[Sequence[memoryview]]) -> list[bool]:
        """Pages into the caller's chunks (written only during the call). A stored value of any
        size but that of the destination's frame is a corrupt miss (removed), read no further
        than one byte past that frame: the namespace of a daemon's keys names its pools'
        layouts, so a page of another size under one is not the daemon's. Thread-safe."""
        check_batch(keys, dests, "destinations")
        frames = [self._codec.header_size + chunks_nbytes(chunks) for chunks in dests]
        ok = [
            scatter_into(payload, chunks)
            for payload, chunks in zip(self._fetch(keys, frames), dests, strict=True)
        ]
        self._reads.count(ok)
        return ok

    # ----------------------------------------------------------------- writes

    def _store(self, keys: Sequence[str], frames: Sequence[bytes | None]) -> list[bool]:
        """SET NX each frame; None (a page over ``max_value_bytes``) is refused, not sent."""
        results: list[bool] = []
        ex = self.config.ttl_s or None
        for batch in self._batches(len(keys)):
            sent = [(i, blob) for i in batch if (blob := frames[i]) is not None]
            replies: dict[int, Any] = {}
            if sent:
                pipe = self._client.pipeline(transaction=False)
                for i, blob in sent:
                    pipe.set(self._full(keys[i]), blob, nx=True, ex=ex)
                answers = self._call(pipe.execute, raise_on_error=False)
                replies = dict(zip([i for i, _blob in sent], answers, strict=True))
            for i in batch:
                if i not in replies:  # over max_value_bytes (logged)
                    results.append(False)
                elif isinstance(replies[i], Exception):
                    log.warning("redis backend: SET %r refused: %s", keys[i], replies[i])
                    results.append(False)
                else:  # True: stored; None: already present (NX), also a success
                    results.append(True)
        return results

    def _frame(self, key: str, chunks: Sequence[bytes | memoryview]) -> bytes | None:
        """``key``'s frame of ``chunks``, or None (logged) when it would be over
        ``max_value_bytes``: ``get`` reads no more than that, so it is never stored."""
        size = self._codec.header_size + sum(memoryview(c).nbytes for c in chunks)
        if size > self.config.max_value_bytes:
            log.warning(
                "redis backend: page %r (%d bytes framed) is over max_value_bytes=%d; not stored",
                key,
                size,
                self.config.max_value_bytes,
            )
            return None
        return self._codec.frame(key, chunks)

    def set(self, keys: Sequence[str], values: Sequence[bytes | memoryview]) -> list[bool]:
        check_batch(keys, values, "values")
        return self._store(keys, [self._frame(key, [value]) for key, value in zip(keys, values, strict=True)])

    def set_from(self, keys: Sequence[str], srcs: Sequence[Sequence[memoryview]]) -> list[bool]:
        check_batch(keys, srcs, "sources")
        return self._store(keys, [self._frame(key, chunks) for key, chunks in zip(keys, srcs, strict=True)])

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
                payload += sum(max(0, n - self._codec.header_size) for n in sizes)
            if not cursor:
                return pages, payload

    def stats(self) -> BackendStats:
        info = self._call(self._client.info)
        pages, payload = self._ours()
        reads = self._reads.snapshot()
        return BackendStats(
            pages=pages,
            bytes=payload,
            capacity_bytes=int(info.get("maxmemory", 0)),
            hits=reads.hits,
            misses=reads.misses,
            corrupt_pages=reads.corrupt_pages,
            evicted_pages=int(info.get("evicted_keys", 0)),
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._client.close()
