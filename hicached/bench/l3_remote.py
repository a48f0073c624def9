"""Remote L3 backends beside their bare client libraries, on servers this
benchmark starts on loopback and stops (measured in one run, same pages).

Pages are 64 KiB, moved in batches of 128; every figure is GB/s (10**9 B/s):

* ``s3_put_gbps`` / ``s3_get_gbps``: the ``s3`` backend (``set_from`` /
  ``get_into``, framing and verification included) against a SeaweedFS S3
  gateway (``weed server -s3``); ``s3_raw_put_gbps`` / ``s3_raw_get_gbps``:
  bare boto3 ``put_object``/``get_object`` of the same pages on the same
  number of threads (the limit). ``s3_1mib_raw_put_gbps``: bare boto3 with
  1 MiB objects, showing what per-request cost leaves on the table.
* ``mooncake_put_gbps`` / ``mooncake_get_gbps``: the ``mooncake`` backend
  against ``mooncake_master`` plus a ``mooncake_client`` segment host over
  TCP; ``mooncake_raw_put_gbps`` / ``mooncake_raw_get_gbps``: bare
  ``batch_put_from`` / ``batch_get_into`` from one registered buffer.

A backend whose server or library is missing is left out with a logged note.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from hicached.bench.timing import gbps, timed
from hicached.testing.procs import LOOPBACK
from hicached.testing.servers import mooncake_master, seaweedfs

log = logging.getLogger(__name__)

PAGE_BYTES = 64 << 10
BATCH = 128
S3_THREADS = 8


class _Pages:
    def __init__(self, n: int) -> None:
        self.n = n
        self.source = memoryview(bytearray(os.urandom(n * PAGE_BYTES)))
        self.dest = memoryview(bytearray(n * PAGE_BYTES))
        self.dest[:] = b"\0" * len(self.dest)  # fault it in before timing

    def page(self, i: int) -> memoryview:
        return self.source[i * PAGE_BYTES : (i + 1) * PAGE_BYTES]

    def dest_page(self, i: int) -> memoryview:
        return self.dest[i * PAGE_BYTES : (i + 1) * PAGE_BYTES]

    def batches(self) -> Iterator[range]:
        for start in range(0, self.n, BATCH):
            yield range(start, min(start + BATCH, self.n))

    @property
    def nbytes(self) -> int:
        return self.n * PAGE_BYTES


def _through_backend(backend: Any, pages: _Pages, prefix: str) -> tuple[float, float]:
    keys = [f"{prefix}/{i:08d}" for i in range(pages.n)]

    def put() -> None:
        for batch in pages.batches():
            if not all(backend.set_from([keys[i] for i in batch], [[pages.page(i)] for i in batch])):
                raise RuntimeError(f"{backend.name} backend refused a page during the benchmark")

    def get() -> None:
        for batch in pages.batches():
            dests = [[pages.dest_page(i)] for i in batch]
            if not all(backend.get_into([keys[i] for i in batch], dests)):
                raise RuntimeError(f"{backend.name} backend missed a page during the benchmark")

    put_s, get_s = timed(put), timed(get)
    if pages.dest != pages.source:
        raise RuntimeError(f"{backend.name} backend returned wrong bytes during the benchmark")
    return gbps(pages.nbytes, put_s), gbps(pages.nbytes, get_s)


# ------------------------------------------------------------------------ S3


def _s3(pages: _Pages, workdir: Path) -> dict[str, float]:
    import boto3
    from botocore.config import Config

    from hicached.l3.s3 import S3Backend, S3BackendConfig

    out: dict[str, float] = {}
    # weed's own volume limits: the benchmark writes hundreds of MiB (the tests' small ones would not do).
    with seaweedfs(volume_size_limit_mb=None, max_volumes=None, parent=workdir) as srv:
        endpoint, bucket = srv.endpoint_url, srv.bucket
        client: Any = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=srv.access_key_id,
            aws_secret_access_key=srv.secret_access_key,
            region_name="us-east-1",
            config=Config(
                max_pool_connections=S3_THREADS,
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )
        pool = ThreadPoolExecutor(S3_THREADS)
        keys = [f"raw/{i:08d}" for i in range(pages.n)]
        bodies = [bytes(pages.page(i)) for i in range(pages.n)]  # boto3 takes no memoryview

        def raw_put() -> None:
            list(
                pool.map(
                    lambda i: client.put_object(Bucket=bucket, Key=keys[i], Body=bodies[i]),
                    range(pages.n),
                )
            )

        def raw_get() -> None:
            list(
                pool.map(
                    lambda i: client.get_object(Bucket=bucket, Key=keys[i])["Body"].read(), range(pages.n)
                )
            )

        out["s3_raw_put_gbps"] = gbps(pages.nbytes, timed(raw_put))
        out["s3_raw_get_gbps"] = gbps(pages.nbytes, timed(raw_get))
        big = bytes(pages.source[: 1 << 20])
        count = max(1, pages.nbytes // len(big))

        def raw_put_1mib() -> None:
            list(pool.map(lambda i: client.put_object(Bucket=bucket, Key=f"big/{i}", Body=big), range(count)))

        out["s3_1mib_raw_put_gbps"] = gbps(count * len(big), timed(raw_put_1mib))
        pool.shutdown()
        client.close()
        config = S3BackendConfig(
            bucket=bucket,
            endpoint_url=endpoint,
            access_key_id=srv.access_key_id,
            secret_access_key=srv.secret_access_key,
            threads=S3_THREADS,
        )
        backend = S3Backend(config)
        try:
            out["s3_put_gbps"], out["s3_get_gbps"] = _through_backend(backend, pages, "l3")
        finally:
            backend.close()
    return out


# ------------------------------------------------------------------ Mooncake


def _mooncake_bench(pages: _Pages, workdir: Path) -> dict[str, float]:
    from mooncake.store import MooncakeDistributedStore

    from hicached.l3.mooncake import MooncakeBackend, MooncakeBackendConfig

    out: dict[str, float] = {}
    # Room for the raw and the backend's copies of every page, plus headroom.
    with mooncake_master(segment_bytes=3 * pages.nbytes + (64 << 20), parent=workdir) as srv:
        master_addr = srv.master_addr
        store: Any = MooncakeDistributedStore()
        if store.setup(LOOPBACK, "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master_addr) != 0:
            raise RuntimeError("mooncake client setup failed")
        buffer = np.zeros(pages.nbytes, np.uint8)
        buffer[:] = np.frombuffer(pages.source, np.uint8)
        addr = int(buffer.ctypes.data)
        try:
            if store.register_buffer(addr, buffer.nbytes) != 0:
                raise RuntimeError("mooncake register_buffer failed")
            keys = [f"raw/{i:08d}" for i in range(pages.n)]

            def raw_put() -> None:
                for batch in pages.batches():
                    rcs = store.batch_put_from(
                        [keys[i] for i in batch],
                        [addr + i * PAGE_BYTES for i in batch],
                        [PAGE_BYTES] * len(batch),
                    )
                    if any(rc != 0 for rc in rcs):
                        raise RuntimeError("mooncake refused a page during the benchmark")

            def raw_get() -> None:
                for batch in pages.batches():
                    rcs = store.batch_get_into(
                        [keys[i] for i in batch],
                        [addr + i * PAGE_BYTES for i in batch],
                        [PAGE_BYTES] * len(batch),
                    )
                    if any(rc != PAGE_BYTES for rc in rcs):
                        raise RuntimeError("mooncake missed a page during the benchmark")

            out["mooncake_raw_put_gbps"] = gbps(pages.nbytes, timed(raw_put))
            out["mooncake_raw_get_gbps"] = gbps(pages.nbytes, timed(raw_get))
            store.unregister_buffer(addr)
        finally:
            store.close()
        backend = MooncakeBackend(
            MooncakeBackendConfig(master_addr=master_addr, staging_bytes=BATCH * (PAGE_BYTES + 4096))
        )
        try:
            out["mooncake_put_gbps"], out["mooncake_get_gbps"] = _through_backend(backend, pages, "l3")
        finally:
            backend.close()
    return out


def run(quick: bool, workdir: Path | None = None, pages_count: int | None = None) -> dict[str, float]:
    """S3 and Mooncake backends beside their bare clients (GB/s); see the module docstring.

    1000 pages (quick) or 4000, unless ``pages_count`` says otherwise (tests).
    """
    pages = _Pages(pages_count or (1000 if quick else 4000))
    scratch = Path(workdir or tempfile.gettempdir()) / f"bench-l3r-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    results: dict[str, float] = {}
    for name, bench in (("s3", _s3), ("mooncake", _mooncake_bench)):
        folder = scratch / name
        folder.mkdir(parents=True)
        try:
            results.update(bench(pages, folder))
        except (FileNotFoundError, ImportError) as exc:
            log.warning("%s figures omitted (not installed here): %s", name, exc)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(scratch, ignore_errors=True)
    return results
