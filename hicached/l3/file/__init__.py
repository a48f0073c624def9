"""The embedded L3 backend: pages in slot files on a local disk (see :mod:`.backend`).

Modules, one concept each: :mod:`.layout` (slot sizes and the self-verifying slot
header), :mod:`.slabs` (slab files and their allocators), :mod:`.index` (key -> slot
index, LRU eviction, the start-up scan), :mod:`.extents` (which slot headers the scan
reads: those not in a hole), :mod:`.io` (vectored runs of slots on a thread pool), :mod:`.options` (``[l3.file]``) and :mod:`.backend` (the
:class:`~hicached.l3.base.StorageBackend` that ties them together). Importing this
package registers the ``file`` backend.
"""

from hicached.l3.file.backend import FileBackend
from hicached.l3.file.layout import HEADER_BYTES, MAX_KEY_BYTES, slot_bytes_for
from hicached.l3.file.options import FileBackendConfig

__all__ = ["HEADER_BYTES", "MAX_KEY_BYTES", "FileBackend", "FileBackendConfig", "slot_bytes_for"]
