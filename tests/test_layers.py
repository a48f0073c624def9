"""The daemon's imports go down its layers (docs/architecture.md), never up.

Every ``import`` of a ``hicached`` module, at module level or inside a function, is checked
against the rank of the importing module's room: a room may import rooms of a higher rank
number only (one room may import itself). ``l2``, ``l3`` and ``transfer`` share a rank, so
none imports another; what two of them both need lives below them (``page_arrays``, ``shm``).
A function-level import hid the one such import that was there (transfer -> l2.shm).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "hicached"

# Room -> rank; lower ranks sit higher (they may import any rank below them).
RANKS: dict[str, float] = {
    "__main__": 0, "cli": 0.2, "commands": 0.4, "bench": 0.6,
    "testing": 0.7,  # the harness of tests and bench: the daemon never imports it
    "daemon": 1,
    "startup": 2, "shutdown": 2, "observability": 2,
    "server": 3, "metrics": 3, "metrics_http": 3.5,
    "core": 4,
    "index": 5,
    "config": 4.5,  # above index and l3: it holds their option types (backend tables)
    "l2": 6, "l3": 6, "transfer": 6,
    "page_arrays": 7, "shm": 7, "accept": 7, "paths": 7, "policies": 7, "page_keys": 7,
    "coerce": 8, "logs": 8, "tasks": 8, "errors": 8.5,
    "hicached": 9,  # the package itself: its version
}  # fmt: skip


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _imports(path: Path) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [(n, node.lineno) for n in names if n == "hicached" or n.startswith("hicached.")]
    return found


def test_every_room_has_a_rank() -> None:
    rooms = {p.stem if p.is_file() else p.name for p in ROOT.iterdir() if p.suffix == ".py" or p.is_dir()}
    rooms -= {"__pycache__", "__init__"}
    assert rooms <= RANKS.keys(), f"rooms without a rank here: {sorted(rooms - RANKS.keys())}"


def test_imports_go_down_the_layers() -> None:
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        room = _room(module)
        for imported, line in _imports(path):
            target = _room(imported)
            if target != room and RANKS[target] <= RANKS[room]:
                upward.append(
                    f"{path.relative_to(ROOT.parent)}:{line} ({room}) imports {imported} ({target})"
                )
    assert not upward, "imports that do not go down the layers:\n" + "\n".join(upward)
