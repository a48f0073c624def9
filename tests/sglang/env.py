"""Import SGLang 0.5.23's real HiCache classes on a CPU-only test machine.

``pip install --no-deps sglang==0.5.23`` plus its CPU import dependencies
(see ``./dev``) is enough for ``hicache_storage``, the storage backend factory
and the host pools, except for one module: SGLang's config package imports
``torchvision`` at module level for multimodal preprocessing, and PyPI serves
only CUDA builds of torchvision for Linux, which cannot load next to the CPU
torch build (``libc10_cuda.so`` is missing). We therefore install a minimal
stand-in exposing only the two names SGLang touches at import time
(``torchvision.transforms`` and ``InterpolationMode``), after transformers has
recorded that torchvision is absent (so transformers never uses the stand-in).
No HiCache code path touches torchvision. On a machine where torchvision
imports (every GPU machine), the real one is used.

``import tests.sglang.env`` first, then import SGLang.
"""

from __future__ import annotations

import enum
import importlib.machinery
import sys
import types


def _torchvision_imports() -> bool:
    try:
        import torchvision  # noqa: F401
    except (ImportError, OSError, RuntimeError):
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        return False
    return True


def _install_torchvision_stand_in() -> None:
    from transformers.utils import import_utils

    # Cached (lru_cache) before the stand-in exists: transformers keeps seeing no torchvision.
    if import_utils.is_torchvision_available():
        raise RuntimeError("transformers sees a torchvision that does not import")

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"

    def module(name: str) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
        return mod

    root, transforms, functional = (
        module("torchvision"),
        module("torchvision.transforms"),
        module("torchvision.transforms.functional"),
    )
    functional.InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
    transforms.InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
    transforms.functional = functional  # type: ignore[attr-defined]
    root.transforms = transforms  # type: ignore[attr-defined]
    sys.modules.update({m.__name__: m for m in (root, transforms, functional)})


if not _torchvision_imports():
    _install_torchvision_stand_in()
