"""No hand-written module grows past :data:`MAX_LINES` (see docs/architecture.md: one room, one job).

A module that outgrows it is split by concept. Generated code (``hicached_client/v1``) is exempt.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 500


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def _modules() -> list[Path]:
    paths = [*(ROOT / "hicached").rglob("*.py"), *(ROOT / "clients/python/hicached_client").rglob("*.py")]
    return sorted(p for p in paths if "v1" not in p.relative_to(ROOT).parts)


def test_the_scan_sees_the_packages() -> None:
    """Guards the check below against an empty scan (it would pass vacuously)."""
    assert len(_modules()) > 50


def test_no_module_over_the_line_limit() -> None:
    over = {rel: n for p in _modules() if (n := _lines(p)) > MAX_LINES and (rel := str(p.relative_to(ROOT)))}
    assert not over, f"modules over {MAX_LINES} lines (split them by concept): {over}"
