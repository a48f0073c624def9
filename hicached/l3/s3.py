"""The ``s3`` L3 backend: pages as objects in an S3-compatible bucket (boto3).

Object layout. Page ``key`` is stored as one object named
``<prefix><escaped key>`` whose body is one self-verifying frame from
:mod:`hicached.l3.framing` (32-byte header with the key's and the payload's
XXH3, or with ``l3.auth_key_file`` a 48-byte header with an HMAC of both, then
the payload). ``escaped key`` keeps ``[A-Za-z0-9_-]`` and writes
every other UTF-8 byte as ``%XX``: the object namespace is flat (no ``/``
path segments, no ``.``/``..`` that a filer-backed store such as SeaweedFS
would normalise), and escaping byte by byte keeps prefixes, so
``clear(prefix)`` is one ``ListObjectsV2`` over ``<prefix><escaped prefix>``.
Any daemon pointed at the same bucket and prefix sees the same pages at once:
there is no local index to go stale.

Why one object per page. Batching pages into larger objects would cut the
per-request cost (measured with SeaweedFS + boto3: 64 KiB PUTs ~20 MB/s,
1 MiB PUTs ~150 MB/s) but needs an index that every daemon sharing the bucket
must keep coherent and a compactor for deleted pages; the content-addressed
one-object-per-page layout keeps ``exists``/``get``/``delete`` single
requests, needs no coordination between writers, and batches of pages go out
as concurrent requests on ``threads`` pooled connections instead.

Writes. ``set`` sends ``PUT`` with ``If-None-Match: *``: an existing key
answers 412 and counts as stored without being rewritten (content-addressed
keys: same key, same bytes). For stores that do not honour conditional
writes, ``conditional_put=False`` sends a ``HEAD`` first instead. A ``True``
result means the store acknowledged the PUT (S3 durability). boto3's own
request checksums are turned off: the frame's XXH3 already covers the payload
end to end, from the writer's memory to the reader's.

Reads. No more of a body is read than the reader can take (the frame of its
destination, or ``max_object_bytes``), whatever ``Content-Length`` says or
whether it is sent at all. Every body is verified before it is served; a truncated, mislabelled
or corrupt object is a miss, counted in ``corrupt_pages``, and deleted so a
later ``set`` can store the page again (otherwise ``If-None-Match`` would keep
the broken object forever). With plain frames every writer of the bucket is
trusted with every page; with an authenticated codec (``l3.auth_key_file``) an
object without a valid MAC, a plain frame included, is such a corrupt miss. A request that fails for any other reason (server
down, timeout after boto3's retries) is a miss/``False`` and is logged.

A stalled or unreachable store costs one request's timeout per call, not one
per key: once a request of a call fails to reach the store (a connection
error or a timeout, after boto3's retries), the call's requests not yet sent
fail at once without being sent. The next call tries the store again.

Thread-safety: the boto3 client is thread-safe; requests of one call run on a
private thread pool of ``threads`` workers; counters sit under one lock.
``close()`` waits for queued requests, then closes the connection pool.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import unquote

from hicached.errors import InvalidArgument, Unavailable, clip
from hicached.l3.base import BackendStats, ReadCounters, StorageBackend, check_batch, scatter_into
from hicached.l3.framing import PLAIN, FrameCodec
from hicached.l3.registry import L3Backend, register_backend
from hicached.l3.s3_config import MAX_OBJECT_KEY_BYTES, S3BackendConfig

__all__ = ["S3Backend", "S3BackendConfig", "escape_key", "unescape_key"]

log = logging.getLogger(__name__)

_DELETE_BATCH = 1000  # S3's limit on DeleteObjects
_UNSAFE = re.compile(rb"[^A-Za-z0-9_-]")
_MISSING_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
_EXISTS_CODES = frozenset({"412", "PreconditionFailed"})
_DENIED_CODES = frozenset({"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"})
_INSTALL_HINT = "the s3 backend needs boto3: pip install 'hicached[s3]'"

_Buffer = bytes | bytearray | memoryview
T = TypeVar("T")
R = TypeVar("R")


def escape_key(key: str) -> str:
    """The object-name form of a page key (see the module docstring); prefix-preserving."""
    return _UNSAFE.sub(lambda m: b"%%%02X" % m.group()[0], key.encode("utf-8")).decode("ascii")


def unescape_key(name: str) -> str:
    return unquote(name, encoding="utf-8", errors="strict")


class _Unreachable(Exception):
    """A request found the store unreachable (logged); its call's unsent requests fail at once."""


def _error_code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None
    code = response.get("Error", {}).get("Code")
    if code is None:
        code = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return None if code is None else str(code)


@register_backend(
    L3Backend.S3,
    S3BackendConfig,
    framed=True,
    fix_keys="l3.s3.endpoint_url, l3.s3.bucket and the credentials (l3.s3.access_key_id)",
)
class S3Backend(StorageBackend):
    """Pages as framed objects in an S3 bucket; see the module docstring."""

    name = "s3"

    def __init__(self, config: S3BackendConfig, *, codec: FrameCodec = PLAIN) -> None:
        try:
            import boto3
            from botocore.config import Config
            from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError, NoCredentialsError
            from botocore.exceptions import ConnectionError as BotoConnectionError
        except ImportError as exc:
            raise InvalidArgument(_INSTALL_HINT) from exc
        self.config = config
        self._codec = codec
        self._errors: tuple[type[BaseException], ...] = (BotoCoreError, ClientError)
        self._no_credentials: type[BaseException] = NoCredentialsError
        # Connection errors and timeouts (after boto3's retries): the store, not the key.
        self._unreachable: tuple[type[BaseException], ...] = (BotoConnectionError, HTTPClientError)
        self._lock = threading.Lock()  # the last listing and the closed flag
        self._reads = ReadCounters()
        self._listed: tuple[float, int, int] | None = None  # (monotonic time, pages, bytes)
        self._closed = False
        boto_config = Config(
            region_name=config.region,
            max_pool_connections=config.threads,
            connect_timeout=config.connect_timeout_s,
            read_timeout=config.read_timeout_s,
            retries={"total_max_attempts": config.max_attempts, "mode": "standard"},
            s3={"addressing_style": config.addressing_style},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        credentials: dict[str, str] = {}
        if config.access_key_id:
            credentials = {
                "aws_access_key_id": config.access_key_id,
                "aws_secret_access_key": config.secret_access_key,
            }
        try:
            self._client: Any = boto3.session.Session().client(
                "s3", endpoint_url=config.endpoint_url or None, config=boto_config, **credentials
            )
        except (ValueError, BotoCoreError) as exc:  # a malformed endpoint or region
            raise InvalidArgument(f"s3 backend: {exc} (l3.s3.endpoint_url / l3.s3.region)") from None
        try:
            self._ensure_bucket()
        except BaseException:
            self._client.close()
            raise
        self._pool = ThreadPoolExecutor(config.threads, thread_name_prefix="hicached-s3")

    # ---------------------------------------------------------------- helpers

    def _where(self) -> str:
        return f"{self.config.endpoint_url or 'aws'}/{self.config.bucket}/{self.config.prefix}"

    def _ensure_bucket(self) -> None:
        bucket = self.config.bucket
        try:
            self._client.head_bucket(Bucket=bucket)
            return
        except self._errors as exc:
            code = _error_code(exc)
            if isinstance(exc, self._no_credentials) or code in _DENIED_CODES:
                raise InvalidArgument(
                    f"s3 backend credentials for bucket {bucket!r} are missing or rejected ({exc}); "
                    "set access_key_id/secret_access_key or the AWS_* environment"
                ) from exc
            if code not in _MISSING_CODES and code != "NoSuchBucket":
                raise Unavailable(
                    f"s3 backend cannot reach bucket {bucket!r} at {self._where()}: {exc}"
                ) from exc
        if not self.config.create_bucket:
            raise InvalidArgument(
                f"s3 bucket {bucket!r} does not exist at {self.config.endpoint_url or 'aws'} "
                "(set create_bucket=true to create it)"
            )
        try:
            self._client.create_bucket(Bucket=bucket)
        except self._errors as exc:
            if _error_code(exc) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise Unavailable(f"s3 backend could not create bucket {bucket!r}: {exc}") from exc

    max_key_bytes = MAX_OBJECT_KEY_BYTES

    def name_bytes(self, key: str) -> int:
        return len((self.config.prefix + escape_key(key)).encode("utf-8"))

    def _object_names(self, keys: Sequence[str]) -> list[str]:
        """Object names for ``keys``, all checked before any request is sent."""
        names = []
        for key in keys:
            if not isinstance(key, str) or not key:
                raise InvalidArgument(f"storage key must be a non-empty str, got {key!r}")
            name = self.config.prefix + escape_key(key)
            if len(name) > MAX_OBJECT_KEY_BYTES:
                raise InvalidArgument(
                    f"storage key {clip(key)} is too long for S3: object name {len(name)} bytes "
                    f"> {MAX_OBJECT_KEY_BYTES}"
                )
            names.append(name)
        return names

    def _map(self, fn: Callable[[T], R], items: Sequence[T], failed: R) -> list[R]:
        """``fn`` over ``items`` on the request pool. Once one request raises
        :class:`_Unreachable`, it and the requests not yet sent answer ``failed``."""
        if self._closed:
            raise Unavailable(f"s3 backend {self._where()} is closed")
        down = threading.Event()
        skipped: list[None] = []  # list.append is atomic; read after every request ended

        def one(item: T) -> R:
            if down.is_set():
                skipped.append(None)
                return failed
            try:
                return fn(item)
            except _Unreachable:
                down.set()
                return failed

        try:
            results = list(self._pool.map(one, items))
        except RuntimeError as exc:  # pool shut down by a concurrent close()
            raise Unavailable(f"s3 backend {self._where()} is closed") from exc
        if skipped:
            log.warning(
                "s3 backend %s: store unreachable; %d of %d requests of this call not sent",
                self._where(),
                len(skipped),
                len(items),
            )
        return results

    def _failed(self, exc: BaseException, what: str) -> None:
        """Log a failed request; raise :class:`_Unreachable` when the store, not the key, failed."""
        log.warning("s3 backend %s: %s failed: %s", self._where(), what, exc)
        if isinstance(exc, self._unreachable):
            raise _Unreachable from exc

    def _head(self, name: str) -> bool:
        return self._head_state(name) is True

    def _head_state(self, name: str) -> bool | None:
        """True present, False absent, None: the store did not say (logged)."""
        try:
            self._client.head_object(Bucket=self.config.bucket, Key=name)
            return True
        except self._errors as exc:
            if _error_code(exc) in _MISSING_CODES:
                return False
            self._failed(exc, f"HEAD {name}")
            return None

    def _fetch(self, item: tuple[str, str, int | None]) -> memoryview | None:
        """The verified payload of one page, or None (miss; corrupt objects are removed).
        ``item``: key, object name, and the payload size the caller can take (None: up to
        ``max_object_bytes`` in all); a larger object is a miss, not read past that bound (it
        may be anyone's, of any size)."""
        key, name, most = item
        limit = self.config.max_object_bytes if most is None else most + self._codec.header_size
        try:
            reply = self._client.get_object(Bucket=self.config.bucket, Key=name)
            body = reply["Body"]
            try:
                length = reply.get("ContentLength")
                if isinstance(length, int) and length > limit:
                    return None
                # Bounded even when the store sends no Content-Length (a chunked body): closing
                # the body after a partial read drops the connection instead of draining it.
                blob = body.read(limit + 1)
            finally:
                body.close()
            if len(blob) > limit:
                log.warning(
                    "s3 backend %s: object %s is larger than the %d bytes a page read takes; a miss",
                    self._where(),
                    clip(name),
                    limit,
                )
                return None
        except self._errors as exc:
            if _error_code(exc) not in _MISSING_CODES:
                self._failed(exc, f"GET {name}")
            return None
        payload, why = self._codec.verify(key, blob)
        if payload is None:
            log.warning(
                "s3 backend %s: object %s failed verification (%s); removing it", self._where(), name, why
            )
            self._reads.corrupt()
            try:
                self._client.delete_object(Bucket=self.config.bucket, Key=name)
            except self._errors as exc:
                log.warning("s3 backend %s: could not remove corrupt %s: %s", self._where(), name, exc)
        return payload

    def _store(self, item: tuple[str, str, Sequence[_Buffer]]) -> bool:
        key, name, chunks = item
        bucket = self.config.bucket
        try:
            if not self.config.conditional_put:
                if self._head(name):
                    return True
                self._client.put_object(Bucket=bucket, Key=name, Body=self._codec.frame(key, chunks))
                return True
            self._client.put_object(
                Bucket=bucket, Key=name, Body=self._codec.frame(key, chunks), IfNoneMatch="*"
            )
            return True
        except self._errors as exc:
            if _error_code(exc) in _EXISTS_CODES:
                return True
            self._failed(exc, f"PUT {name}")
            return False

    def _put(
        self, keys: Sequence[str], srcs: Sequence[Sequence[bytes | bytearray | memoryview]]
    ) -> list[bool]:
        names = self._object_names(keys)
        # A key repeated in the batch is sent once (its first value) and shares
        # that result: concurrent conditional PUTs of one name may both win.
        first: dict[str, int] = {}
        for i, name in enumerate(names):
            first.setdefault(name, i)
        todo = list(first.values())
        sent = self._map(self._store, [(keys[i], names[i], srcs[i]) for i in todo], False)
        result = dict(zip(todo, sent, strict=True))
        return [result[first[name]] for name in names]

    def _delete_names(self, names: Sequence[str]) -> int:
        deleted = 0
        for start in range(0, len(names), _DELETE_BATCH):
            batch = names[start : start + _DELETE_BATCH]
            try:
                reply = self._client.delete_objects(
                    Bucket=self.config.bucket,
                    Delete={"Objects": [{"Key": n} for n in batch], "Quiet": False},
                )
            except self._errors as exc:
                # Reported, not skipped: a clear that deleted nothing must not read as done.
                raise Unavailable(
                    f"s3 backend {self._where()}: DeleteObjects failed after {deleted} deletions: {exc}"
                ) from None
            deleted += len(reply.get("Deleted", []))
            for error in reply.get("Errors", []):
                log.warning("s3 backend %s: could not delete %s: %s", self._where(), error.get("Key"), error)
        return deleted

    def _list(self, prefix: str) -> Iterable[list[dict[str, Any]]]:
        """Pages of ``ListObjectsV2`` entries under ``prefix`` (full object-name prefix)."""
        paginator = self._client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.config.bucket, Prefix=prefix):
            yield page.get("Contents", [])

    # ------------------------------------------------------------- interface

    def exists(self, keys: Sequence[str]) -> int:
        names = self._object_names(keys)
        # HEAD one window of concurrent requests at a time; stop at the first miss.
        window = self.config.threads
        count = 0
        for start in range(0, len(names), window):
            found = self._map(self._head, names[start : start + window], False)
            for present in found:
                if not present:
                    return count
                count += 1
        return count

    def present(self, keys: Sequence[str]) -> list[bool]:
        return [bool(found) for found in self._map(self._head, self._object_names(keys), False)]

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        names = self._object_names(keys)
        payloads = self._map(self._fetch, [(k, n, None) for k, n in zip(keys, names, strict=True)], None)
        pages = [None if p is None else bytes(p) for p in payloads]
        self._reads.count([p is not None for p in pages])
        return pages

    def get_into(self, keys: Sequence[str], dests: Sequence[Sequence[memoryview]]) -> list[bool]:
        check_batch(keys, dests, "destinations")
        names = self._object_names(keys)
        sizes = [sum(memoryview(c).nbytes for c in chunks) for chunks in dests]
        payloads = self._map(self._fetch, list(zip(keys, names, sizes, strict=True)), None)
        ok = [scatter_into(payload, chunks) for payload, chunks in zip(payloads, dests, strict=True)]
        self._reads.count(ok)
        return ok

    def set(self, keys: Sequence[str], values: Sequence[bytes | memoryview]) -> list[bool]:
        check_batch(keys, values, "values")
        return self._put(keys, [[v] for v in values])

    def set_from(self, keys: Sequence[str], srcs: Sequence[Sequence[memoryview]]) -> list[bool]:
        check_batch(keys, srcs, "sources")
        return self._put(keys, srcs)

    def delete(self, keys: Sequence[str]) -> int:
        names = self._object_names(keys)
        unique = list(dict.fromkeys(names))
        # DeleteObjects reports absent keys as deleted too, so presence comes from HEAD.
        states = self._map(self._head_state, unique, None)
        if None in states:
            raise Unavailable(
                f"s3 backend {self._where()}: could not tell whether {states.count(None)} of {len(unique)} "
                "objects exist; nothing was deleted"
            )
        return self._delete_names([n for n, found in zip(unique, states, strict=True) if found])

    def clear(self, prefix: str = "") -> int:
        if not isinstance(prefix, str):
            raise InvalidArgument(f"clear prefix must be a str, got {prefix!r}")
        if self._closed:
            raise Unavailable(f"s3 backend {self._where()} is closed")
        removed = 0
        try:
            for entries in self._list(self.config.prefix + escape_key(prefix)):
                removed += self._delete_names([e["Key"] for e in entries])
        except self._errors as exc:
            raise Unavailable(f"s3 backend {self._where()}: listing for clear failed: {exc}") from exc
        return removed

    def stats(self) -> BackendStats:
        """The pages and bytes of a listing at most ``stats_ttl_s`` old (a LIST of the whole
        prefix costs a request per 1,000 objects), the read counters, once the store answered:
        between listings a HEAD of the bucket asks. Unavailable when it does not, so that
        GetStats shows the outage beside the last figures (these used to look healthy)."""
        if self._closed:
            raise Unavailable(f"s3 backend {self._where()} is closed")
        now = time.monotonic()
        with self._lock:
            listed = self._listed
        try:
            if listed is None or now - listed[0] > self.config.stats_ttl_s:
                pages = payload = 0
                for entries in self._list(self.config.prefix):
                    pages += len(entries)
                    payload += sum(max(0, int(e["Size"]) - self._codec.header_size) for e in entries)
                listed = (now, pages, payload)
                with self._lock:
                    self._listed = listed
            else:
                self._client.head_bucket(Bucket=self.config.bucket)
        except self._errors as exc:
            raise Unavailable(
                f"s3 store does not answer or refuses ({str(exc)[:120]}) at {self._where()}"
            ) from exc
        reads = self._reads.snapshot()
        return BackendStats(
            pages=listed[1],
            bytes=listed[2],
            capacity_bytes=0,
            hits=reads.hits,
            misses=reads.misses,
            corrupt_pages=reads.corrupt_pages,
            evicted_pages=0,
        )

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        self._client.close()
