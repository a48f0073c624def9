"""The asyncio fast lane uses the blocking one only through its public face.

Before, ``fastlane_aio.py`` called ``FastLane._submit_op``, read ``lane._done`` and
``lane._conn`` and imported ``fastlane._acks`` / ``_transfers``: a rename inside the blocking
lane broke the asyncio one without a type error. What both need is in ``_lane_common.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "clients" / "python" / "hicached_client"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_the_asyncio_lane_touches_no_private_name_of_another_object() -> None:
    tree = ast.parse((PACKAGE / "fastlane_aio.py").read_text())
    found = [
        f"line {node.lineno}: .{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and _private(node.attr)
        and not (isinstance(node.value, ast.Name) and node.value.id == "self")
    ]
    found += [
        f"line {node.lineno}: import {alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "hicached_client.fastlane"
        for alias in node.names
        if _private(alias.name)
    ]
    assert not found, found
