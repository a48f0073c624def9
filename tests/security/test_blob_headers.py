"""Another worker of the tenant cannot crash or exhaust the SGLang adapter's byte path.

The byte path (``hicached_client.sglang.blobs``) stores a tensor by key as chunks, the first
holding a header (byte count, dtype, shape). Any worker of the model and tenant may write
those chunks: serving its bytes under a key is by design, but before, a reader trusted the
header. A byte count of 2**50 made ``exists`` build a list of 7e10 chunk keys (MemoryError
under a 3 GiB limit, the OOM killer without one), and a shape that is negative or does not
hold the byte count made ``get`` raise RuntimeError into SGLang's threads. Each test writes
the header as another worker would (PutBytes through the real client to a real daemon) and
reads it in a process of its own with an address-space limit.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator

import pytest
from hicached_client import HiCacheClient
from hicached_client.sglang.blobs import _HEADER, DAEMON_POOL, MAGIC, BlobStore
from hicached_client.sglang.config import AdapterConfig
from hicached_client.sglang.namespace import KeySpace
from hicached_client.sglang.refusals import RefusalLog
from hicached_client.types import PageBytes, WorkerIdentity

from tests.support.daemon import ROOT, Daemon, start_daemon

MODEL = "org/blob-headers"

# The victim: a BlobStore of the same model and tenant, in a process limited to 3 GiB.
VICTIM = """
import logging, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from hicached_client import HiCacheClient
from hicached_client.sglang.blobs import BlobStore
from hicached_client.sglang.config import AdapterConfig
from hicached_client.sglang.namespace import KeySpace
from hicached_client.sglang.refusals import RefusalLog
from hicached_client.types import WorkerIdentity
target, model, op, key = sys.argv[1:]
with HiCacheClient(target) as client:
    store = BlobStore(client, config=AdapterConfig(target=target), keys=KeySpace("blob", "@t"),
                      identity=WorkerIdentity(instance_id="victim", model_name=model),
                      refusals=RefusalLog(logging.getLogger("victim")))
    try:
        print(repr(store.exists(key) if op == "exists" else store.get(key, None)))
    except BaseException as exc:
        print(f"raised {type(exc).__name__}")
    store.close()
"""


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    d = start_daemon()
    try:
        yield d
    finally:
        d.stop()


def _publish(target: str, key: str, header: bytes) -> None:
    """Write ``header`` as the first chunk of ``key``, as a co-tenant worker can."""
    with HiCacheClient(target) as client:
        store = BlobStore(
            client,
            config=AdapterConfig(target=target),
            keys=KeySpace("blob", "@t"),
            identity=WorkerIdentity(instance_id="co-tenant", model_name=MODEL),
            refusals=RefusalLog(logging.getLogger("co-tenant")),
        )
        name = store.header_key(key)
        chunk = header + bytes(store.chunk_bytes - len(header))
        store.call(lambda s: s.put_bytes([PageBytes(name, DAEMON_POOL, chunk)]))
        store.close()


def _victim(target: str, op: str, key: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", VICTIM, target, MODEL, op, key],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def _header(nbytes: int, ndim: int, *shape: int) -> bytes:
    dims = list(shape) + [0] * (8 - len(shape))
    return _HEADER.pack(MAGIC, nbytes, b"float32", ndim, *dims, bytes(8))


@pytest.mark.parametrize(
    ("name", "header", "op"),
    [
        ("huge-count", _header(1 << 50, 1, 1 << 48), "exists"),
        ("huge-count", _header(1 << 50, 1, 1 << 48), "get"),
        ("negative-dim", _header(16, 1, -4), "get"),
        ("shape-not-bytes", _header(16, 1, 8), "get"),
    ],
    ids=["huge-count-exists", "huge-count-get", "negative-dim", "shape-not-bytes"],
)
def test_a_co_tenants_header_reads_as_a_miss(daemon: Daemon, name: str, header: bytes, op: str) -> None:
    key = f"poisoned-{name}-{op}"
    _publish(daemon.target, key, header)
    assert _victim(daemon.target, op, key) == ("False" if op == "exists" else "None")
