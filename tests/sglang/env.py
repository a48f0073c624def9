"""Make SGLang 0.5.23 importable on this CPU-only machine (see ``hicached_client.sglang.cpu_compat``).

``import tests.sglang.env`` before the first SGLang import.
"""

from hicached_client.sglang.cpu_compat import ensure_sglang_importable

ensure_sglang_importable()
