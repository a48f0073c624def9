"""Benchmarks: each module's ``run(quick: bool) -> dict[str, float]`` measures the daemon
beside the machine's own limit in the same run and prints nothing (``hicached bench`` prints).

A suite that cannot run on this install raises :class:`SuiteSkipped` with what to install;
a part of a suite that cannot run is left out with a WARNING on its module's logger
(``hicached bench`` shows those as notes).
"""

from __future__ import annotations

import importlib
import shutil

# Optional Python packages -> how to get them.
OPTIONAL_PACKAGES: dict[str, str] = {
    "redis": "pip install 'hicached[redis]'",
    "hiredis": "pip install 'hicached[redis]'",
    "boto3": "pip install 'hicached[s3]'",
    "botocore": "pip install 'hicached[s3]'",
    "mooncake": "pip install 'hicached[mooncake]'",
    "sglang": "pip install 'hicached-client[sglang]' (SGLang 0.5.23)",
}


class SuiteSkipped(Exception):
    """The suite cannot run on this install; the message says what is missing and how to get it."""


def missing_package(name: str) -> str | None:
    """``None`` when the package imports; else why not and how to install it."""
    try:
        importlib.import_module(name)
    except ImportError as exc:
        how = OPTIONAL_PACKAGES.get(name, f"pip install {name}")
        return f"Python package {name!r} does not import ({exc}); {how}"
    return None


def missing_program(name: str, how: str) -> str | None:
    """``None`` when ``name`` is on PATH; else why not and ``how`` to install it."""
    return None if shutil.which(name) else f"{name} is not on PATH ({how})"
