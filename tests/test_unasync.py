"""One client source: the blocking client is generated from the asyncio one (issue 14 item 4).

``tools/unasync.py --check`` fails while ``sync.py`` / ``_sync_session.py`` differ from what
the generator writes from ``aio.py`` / ``_aio_session.py`` (an edit to the generated twin, or
an edit to the source without ``./dev unasync``), as ``test_wire_contract`` does for proto/.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _tool() -> Any:
    spec = importlib.util.spec_from_file_location("unasync_tool", ROOT / "tools" / "unasync.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generated_blocking_client_is_current() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "unasync.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr


def test_the_check_catches_a_stale_twin(tmp_path: Path) -> None:
    """The check above could pass vacuously; a twin edited by hand must differ from the output."""
    tool = _tool()
    for source, target in tool.TWINS.items():
        fresh = tool.generate(source, target)
        checked_in = (tool.PACKAGE / target).read_text()
        assert fresh == checked_in
        assert fresh.replace("def ", "def  ", 1) != checked_in


def test_the_renames() -> None:
    tool = _tool()
    source = (
        "async def f(self) -> AsyncSession:\n"
        "    async with self._lock:\n"
        "        return await AsyncBeat(x).__aenter__()  # see ``_aio_backend.py``\n"
    )
    assert tool.unasync(source) == (
        "def f(self) -> Session:\n"
        "    with self._lock:\n"
        "        return Beat(x).__enter__()  # see ``_aio_backend.py``\n"
    )
