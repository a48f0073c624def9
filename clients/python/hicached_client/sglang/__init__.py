"""SGLang integration: use a hicached daemon as SGLang's HiCache L3 storage.

Install with the ``sglang`` extra (``pip install 'hicached-client[sglang]'``) next
to SGLang 0.5.23, then launch SGLang with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "hicached",
        "module_path": "hicached_client.sglang", "class_name": "HiCachedStorage",
        "interface_v1": 1, "hicached": {"target": "unix:///run/hicached/hicached.sock"}}'

``docs/sglang.md`` has the full flag list and a worked example.
``HiCachedStorage`` subclasses SGLang's ``HiCacheStorage``, so it is imported
(with SGLang) on first access only; the configuration and key helpers of this
package import without SGLang.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hicached_client.sglang.config import AdapterConfig, Transport

if TYPE_CHECKING:
    from hicached_client.sglang.storage import HiCachedStorage

__all__ = ["AdapterConfig", "HiCachedStorage", "Transport"]


def __getattr__(name: str) -> Any:
    # SGLang's dynamic factory does getattr(module, class_name): import it then.
    if name == "HiCachedStorage":
        from hicached_client.sglang.storage import HiCachedStorage

        return HiCachedStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
