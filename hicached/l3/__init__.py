"""L3: page keys and the storage backends (local files, Redis/Valkey, S3, Mooncake).

Pure storage: nothing here knows about gRPC, sessions or devices. Backends are
created by name through :func:`hicached.l3.registry.create_backend`.
"""

from hicached.l3.base import BackendStats, StorageBackend
from hicached.l3.keys import chain_seed, page_digest, page_keys
from hicached.l3.registry import backend_names, create_backend

__all__ = [
    "BackendStats",
    "StorageBackend",
    "backend_names",
    "chain_seed",
    "create_backend",
    "page_digest",
    "page_keys",
]
