"""L3: the storage backends (local files, Redis/Valkey, S3, Mooncake).

Pure storage: nothing here knows about gRPC, sessions or devices. Backends are
created by name through :func:`hicached.l3.registry.create_backend`.
Content-key hashing lives in :mod:`hicached.page_keys` (a backend never parses keys).
"""

from hicached.l3.base import BackendStats, StorageBackend
from hicached.l3.registry import backend_names, create_backend

__all__ = [
    "BackendStats",
    "StorageBackend",
    "backend_names",
    "create_backend",
]
