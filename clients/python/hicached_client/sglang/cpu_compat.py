"""Importing SGLang 0.5.23's HiCache classes on a CPU-only machine.

``pip install --no-deps sglang==0.5.23`` plus its CPU import dependencies is
enough for ``hicache_storage``, the storage backend factory and the host pools,
except for one module: SGLang's config package imports ``torchvision`` at module
level (multimodal preprocessing), and PyPI serves only CUDA builds of
torchvision for Linux, which cannot load next to the CPU build of torch
(``libc10_cuda.so`` is missing). :func:`ensure_sglang_importable` then installs
a minimal stand-in exposing only the two names SGLang touches at import time
(``torchvision.transforms`` and ``InterpolationMode``), after transformers has
recorded that torchvision is absent, so transformers never uses it. No HiCache
code path touches torchvision. Where torchvision imports (every GPU machine),
nothing is changed.

For tests, benchmarks and CPU experiments; an SGLang server never needs it.
Call it before the first SGLang import. Not thread-safe (it edits ``sys.modules``).
"""

from __future__ import annotations

import enum
import importlib.machinery
import logging
import sys
import types

log = logging.getLogger(__name__)


def _torchvision_imports() -> bool:
    try:
        import torchvision  # type: ignore[import-not-found]  # noqa: F401
    except (ImportError, OSError, RuntimeError):
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        return False
    return True


class InterpolationMode(enum.Enum):
    """Names of ``torchvision.transforms.InterpolationMode`` that SGLang's configs reference."""

    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"


def _module(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    return mod


def ensure_sglang_importable() -> bool:
    """Install the torchvision stand-in when torchvision cannot import; True if installed."""
    if "torchvision" in sys.modules or _torchvision_imports():
        return False
    from transformers.utils import import_utils

    # lru_cached now, before the stand-in exists: transformers keeps seeing no torchvision.
    if import_utils.is_torchvision_available():
        raise RuntimeError("transformers reports a torchvision that does not import")
    root = _module("torchvision")
    transforms = _module("torchvision.transforms")
    functional = _module("torchvision.transforms.functional")
    functional.InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
    transforms.InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
    transforms.functional = functional  # type: ignore[attr-defined]
    root.transforms = transforms  # type: ignore[attr-defined]
    sys.modules.update({m.__name__: m for m in (root, transforms, functional)})
    log.info("torchvision does not import here: installed a stand-in for SGLang's config imports")
    return True
