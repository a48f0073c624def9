"""Arbitrary tensors by key, for SGLang's generic ``get``/``set`` when no host pool fits.

``HiCacheFile`` stores any tensor under any key; a daemon pool stores pages of
one fixed size. ``BlobStore`` bridges the two over a *byte-only* session
(``PutBytes``/``GetBytes``, no shared memory) of a pool of ``chunk_bytes``
pages: a tensor becomes ``ceil((HEADER + nbytes) / chunk_bytes)`` chunks, chunk 0
under the key ``<daemon key>#h2`` starting with a header (magic, byte count,
dtype, shape, and a stamp: a hash of the tensor), the others under
``<daemon key>#<stamp>#c<i>``. Chunk 0 is stored *last*, so a visible header means
every chunk was stored. The daemon may later evict a data chunk and keep the
header: ``exists`` reads the header for the chunk count and stamp and looks them
all up, ``put`` stores the chunks again unless all are there, and ``get`` of a key
missing a chunk is a miss. Never a wrong tensor: the daemon keeps a key's bytes
once stored (a put of a cached key changes nothing), so without the stamp a new
tensor put under a key whose old data chunks were partly evicted filled only the
missing ones, and ``get`` stitched the two; now its chunks have keys of their own,
and while the old header stays ``put`` answers False.

The session is attached on first use (a tensor stored by key, or the first key
``batch_exists`` looks for here after a KV-pool miss) and again when the daemon no longer knows it
(restart, lease lost). Its pool group is per model and shared by every process
of that model, so a tensor stored by one worker is found by another.

Thread-safety: every method may be called from any thread. Ownership: tensors
passed in are only read; ``get`` writes into the caller's ``target`` or returns
a new tensor.
"""

from __future__ import annotations

import hashlib
import logging
import math
import struct
import threading
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import grpc
import torch

from hicached_client import pool_spec
from hicached_client.errors import HiCacheError
from hicached_client.sglang.config import AdapterConfig
from hicached_client.sglang.namespace import KeySpace
from hicached_client.sglang.refusals import RefusalLog
from hicached_client.sync import HiCacheClient, Session
from hicached_client.types import PageBytes, PoolRole, WorkerIdentity

log = logging.getLogger(__name__)
T = TypeVar("T")

BLOB_POOL = "blob"
DAEMON_POOL = "kv"
# Small enough that a scalar does not waste much, large enough that a page-sized
# tensor is a few dozen chunks.
DEFAULT_CHUNK_BYTES = 16 << 10
# Chunks per PutBytes / GetBytes message (1 MiB at the default chunk size).
CHUNKS_PER_CALL = 64
MAGIC = b"hcblob02"  # 01 had no stamp: tensors stored by key before read as misses
MAX_DIMS = 8
# The most chunks a tensor stored by key may have: the daemon's default
# ``limits.max_keys_per_request`` (one Lookup of every chunk must fit) -- 1 GiB at the
# default chunk size. A header is read from the daemon, where any worker of the tenant
# may have written it: its byte count bounds the key list ``exists`` / ``get`` build.
MAX_CHUNKS = 65_536
# magic, nbytes, dtype name (24 bytes), ndim, shape[MAX_DIMS], stamp
_HEADER = struct.Struct(f"<8sQ24sI{MAX_DIMS}q8s")
HEADER_BYTES = _HEADER.size


class Header(NamedTuple):
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stamp: bytes  # names the data chunks: a hash of the tensor's dtype, shape and bytes


def encode_header(value: torch.Tensor, raw: bytes) -> tuple[bytes, Header]:
    """The header of ``value``, whose bytes are ``raw``: as stored, and what it says."""
    if value.dim() > MAX_DIMS:
        raise ValueError(f"tensor has {value.dim()} dims; at most {MAX_DIMS} can be stored by key")
    dtype = str(value.dtype).removeprefix("torch.").encode()
    shape = list(value.shape) + [0] * (MAX_DIMS - value.dim())
    fields = (MAGIC, len(raw), dtype, value.dim(), *shape)
    stamp = hashlib.blake2b(_HEADER.pack(*fields, b"") + raw, digest_size=8).digest()
    return _HEADER.pack(*fields, stamp), Header(len(raw), value.dtype, tuple(value.shape), stamp)


def decode_header(raw: bytes, max_bytes: int) -> Header | None:
    """What a stored tensor's header says, or None when ``raw`` is no header of ours.

    Another worker of the tenant may have written it: a header whose shape is negative or does
    not hold exactly ``nbytes`` of ``dtype``, or whose ``nbytes`` exceeds ``max_bytes``, is none.
    """
    if len(raw) < HEADER_BYTES:
        return None
    magic, nbytes, dtype_name, ndim, *dims, stamp = _HEADER.unpack_from(raw)
    dtype = getattr(torch, dtype_name.rstrip(b"\0").decode(errors="replace"), None)
    if magic != MAGIC or not isinstance(dtype, torch.dtype) or ndim > MAX_DIMS or nbytes > max_bytes:
        return None
    shape = tuple(dims[:ndim])
    if any(d < 0 for d in shape) or math.prod(shape) * dtype.itemsize != nbytes:
        return None
    return Header(nbytes, dtype, shape, stamp)


class BlobStore:
    """Tensors by key in the daemon (see the module docstring)."""

    def __init__(
        self,
        client: HiCacheClient,
        *,
        config: AdapterConfig,
        identity: WorkerIdentity,
        keys: KeySpace,
        refusals: RefusalLog,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        if chunk_bytes <= HEADER_BYTES:
            raise ValueError(f"chunk_bytes={chunk_bytes} must exceed the {HEADER_BYTES}-byte header")
        self.keys = keys
        self.chunk_bytes = chunk_bytes
        self._client = client
        self._config = config
        self._identity = identity
        self._refusals = refusals
        self._lock = threading.Lock()
        self._session: Session | None = None
        self._closed = False
        # The largest tensor stored or read by key: MAX_CHUNKS chunks, the header included.
        self.max_bytes = MAX_CHUNKS * chunk_bytes - HEADER_BYTES

    # ----------------------------------------------------------------- session

    def _attach(self) -> Session:
        spec = pool_spec(
            DAEMON_POOL,
            role=PoolRole.ANCHOR,
            kind="mla",
            dtype=torch.uint8,
            page_size=1,
            num_layers=1,
            num_heads=1,
            head_dim=self.chunk_bytes,
            k_buffers=[],
            host_layout="page_first",
            host_bytes=max(self._config.blob_host_bytes, self.chunk_bytes),
            data_path="bytes",
        )
        session = self._client.attach(
            self._identity, [spec], lease_ms=self._config.lease_ms, timeout_s=self._config.timeout_s
        )
        log.info("hicached: byte-path store attached (session %s)", session.session_id)
        return session

    def _current(self) -> Session:
        with self._lock:
            if self._closed:
                raise HiCacheError(grpc.StatusCode.CANCELLED, "HiCachedStorage is closed")
            if self._session is None:
                self._session = self._attach()
            return self._session

    def call(self, op: Callable[[Session], T]) -> T:
        """Run ``op`` with the live session (attached on first use, and again once if it was lost)."""
        return self._call(op)

    def _call(self, op: Callable[[Session], T]) -> T:
        session = self._current()
        try:
            return op(session)
        except HiCacheError as exc:
            if exc.code != grpc.StatusCode.NOT_FOUND:
                raise
            log.warning("hicached: byte-path session %s lost (%s); attaching again", session.session_id, exc)
        with self._lock:
            if self._session is session:
                self._session = None
        session.stop_heartbeat()
        return op(self._current())

    # -------------------------------------------------------------------- I/O

    def header_key(self, key: str) -> str:
        # Not the "#c0" of the format before stamps: the daemon keeps a cached key's bytes, so
        # an old header there would have kept the key from being stored again for good.
        return f"{self.keys.daemon_key(key)}#h2"

    def chunk_keys(self, key: str, header: Header) -> list[str]:
        """The keys of every chunk of the tensor ``header`` describes, its header's first."""
        count = max(1, math.ceil((HEADER_BYTES + header.nbytes) / self.chunk_bytes))
        base = f"{self.keys.daemon_key(key)}#{header.stamp.hex()}"
        return [self.header_key(key)] + [f"{base}#c{i}" for i in range(1, count)]

    def put(self, key: str, value: torch.Tensor) -> bool:
        """Store ``value`` under ``key``; True also when ``key`` was already stored."""
        if self.exists(key):
            return True  # HiCacheFile: an existing key is not rewritten (a partial one is)
        if value.dim() > MAX_DIMS:
            log.error("hicached: cannot store key %.64r: %d dims, at most %d", key, value.dim(), MAX_DIMS)
            return False
        if value.numel() * value.element_size() > self.max_bytes:
            log.error("hicached: cannot store key %.64r: more than %d bytes", key, self.max_bytes)
            return False
        raw = value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        header, said = encode_header(value, raw)
        blob = header + raw
        keys = self.chunk_keys(key, said)
        blob += bytes(len(keys) * self.chunk_bytes - len(blob))
        chunks = [
            PageBytes(k, DAEMON_POOL, blob[i * self.chunk_bytes : (i + 1) * self.chunk_bytes])
            for i, k in enumerate(keys)
        ]
        # Header last: once it is visible, every chunk was stored.
        order = chunks[1:] + chunks[:1]
        for lo in range(0, len(order), CHUNKS_PER_CALL):
            batch = order[lo : lo + CHUNKS_PER_CALL]
            try:
                self._call(lambda s: s.put_bytes(batch, tenant=self._config.tenant))  # noqa: B023
            except HiCacheError as exc:
                if exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                self._refusals.refused(BLOB_POOL, len(keys), exc.message)
                return False
        # Stored is what a get would find: a header there already may be another tensor's, whose
        # chunks left (the daemon does not replace a cached key's bytes), and storing this one's
        # may have evicted chunks of its own from a full pool.
        return self.exists(key)

    def exists(self, key: str) -> bool:
        """Every chunk of ``key`` is cached (the header says which)."""
        head = self._fetch([self.header_key(key)])
        header = decode_header(head[:HEADER_BYTES], self.max_bytes) if head else None
        if header is None:
            return False
        keys = self.chunk_keys(key, header)
        if len(keys) == 1:
            return True
        found = self._call(lambda s: s.lookup(keys, tenant=self._config.tenant))
        hits = found.total_hit_pages if self._config.include_l3 else found.l2_hit_pages
        return hits == len(keys)

    def get(self, key: str, target: torch.Tensor | None) -> torch.Tensor | None:
        """The tensor stored under ``key`` (copied into ``target`` when given), or None.

        A stored tensor whose byte count differs from ``target``'s is a miss
        (logged): the caller's buffer is never partly written.
        """
        want = None if target is None else target.numel() * target.element_size()
        data = self._fetch([self.header_key(key)])  # the header names the other chunks
        if not data:
            return None
        header = decode_header(data[:HEADER_BYTES], self.max_bytes)
        if header is None:
            log.warning("hicached: key %.64r holds no valid tensor header; reading as a miss", key)
            return None
        nbytes, dtype, shape, _ = header
        if want is not None and nbytes != want:
            log.warning(
                "hicached: key %.64r holds %d bytes, the target tensor %d; reading as a miss",
                key,
                nbytes,
                want,
            )
            return None
        keys = self.chunk_keys(key, header)
        while len(data) < len(keys) * self.chunk_bytes:
            lo = len(data) // self.chunk_bytes
            more = self._fetch(keys[lo : lo + CHUNKS_PER_CALL])
            if len(more) < min(CHUNKS_PER_CALL, len(keys) - lo) * self.chunk_bytes:
                return None  # a data chunk was evicted after the header was written
            data += more
        out = target if target is not None else torch.empty(shape, dtype=dtype)
        if nbytes:
            payload = torch.frombuffer(
                bytearray(data[HEADER_BYTES : HEADER_BYTES + nbytes]), dtype=torch.uint8
            )
            out.copy_(payload.view(out.dtype).view(out.shape))
        return out

    def _fetch(self, keys: list[str]) -> bytes:
        """Bytes of the leading run of ``keys`` that is cached (whole chunks)."""
        got = self._call(
            lambda s: s.get_bytes(keys, include_l3=self._config.include_l3, tenant=self._config.tenant)
        )
        return b"".join(p.data for p in got.pages[: got.hit_pages])

    def close(self) -> None:
        """Detach the session, if one was attached (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            session, self._session = self._session, None
        if session is not None:
            session.close()
