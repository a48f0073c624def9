"""SGLang integration: use a hicached daemon as SGLang's HiCache L3 storage.

Install with the ``sglang`` extra (``pip install 'hicached-client[sglang]'``) next
to SGLang 0.5.23, then launch SGLang with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "hicached",
        "module_path": "hicached_client.sglang", "class_name": "HiCachedStorage",
        "interface_v1": 1, "hicached": {"target": "unix:///run/hicached/hicached.sock"}}'

``docs/sglang.md`` has the full flag list and a worked example. Importing this
package imports SGLang (``HiCachedStorage`` subclasses its ``HiCacheStorage``).
"""

from hicached_client.sglang.config import AdapterConfig, Transport
from hicached_client.sglang.storage import HiCachedStorage

__all__ = ["AdapterConfig", "HiCachedStorage", "Transport"]
