"""Generate the blocking client from the asyncio client (httpcore's unasync idea).

    python tools/unasync.py          # rewrite the generated twins (or: ./dev unasync)
    python tools/unasync.py --check  # exit 1 if a checked-in twin is stale

The asyncio client is the one source, written by hand; each file in :data:`TWINS` is
turned into its blocking twin by an ordered list of whole-word renames (:data:`RULES`:
``async def`` -> ``def``, ``await`` dropped, ``AsyncSession`` -> ``Session``,
``_aio_backend`` -> ``_sync_backend``, ...), then sorted and formatted with ruff so the
output is the code a person would have written. Literals in double backticks (file names
quoted in prose) are left alone. What a rename cannot express (a task
versus a thread, ``channel_ready`` versus a future) lives in the hand-written pair
``_aio_backend.py`` / ``_sync_backend.py`` under the same names. ``tests/test_unasync.py``
fails while a generated twin differs from what this script writes.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "clients" / "python" / "hicached_client"
TWINS = {"aio.py": "sync.py", "_aio_session.py": "_sync_session.py", "_aio_lane.py": "_sync_lane.py"}

# Applied in order, each as a whole-word regex; the first rules are the more specific.
RULES: list[tuple[str, str]] = [
    (r"async with", "with"),
    (r"async for", "for"),
    (r"async def", "def"),
    (r"await ", ""),
    (r"__aenter__", "__enter__"),
    (r"__aexit__", "__exit__"),
    (r"__aiter__", "__iter__"),
    (r"__anext__", "__next__"),
    (r"StopAsyncIteration", "StopIteration"),
    (r"AsyncIterator", "Iterator"),
    (r"aio_channel", "sync_channel"),
    (r"_aio_backend", "_sync_backend"),
    (r"_aio_session", "_sync_session"),
    (r"_aio_lane", "_sync_lane"),
    (r"fastlane_aio", "fastlane"),
    (r"hicached_client\.aio", "hicached_client.sync"),
    # AsyncHiCacheClient -> HiCacheClient, AsyncSession -> Session, AsyncBeat -> Beat, ...
    (r"Async([A-Z]\w*)", r"\1"),
]
_COMPILED = [(re.compile(rf"\b{pattern}\b"), repl) for pattern, repl in RULES]


def header(source: str) -> str:
    return f"# Generated from {source} by tools/unasync.py (./dev unasync). Do not edit.\n"


# ``literal`` spans in docstrings and comments (file names, code quoted in prose) stay as written.
_LITERAL = re.compile(r"(``[^`\n]+``)")


def unasync(text: str) -> str:
    parts = _LITERAL.split(text)
    for i in range(0, len(parts), 2):  # the odd parts are the literals
        for pattern, repl in _COMPILED:
            parts[i] = pattern.sub(repl, parts[i])
    return "".join(parts)


def _ruff(args: list[str], text: str, name: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--stdin-filename", str(name), "-"],
        input=text,
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"ruff {' '.join(args)} failed on {name.name}:\n{done.stderr}")
    return done.stdout


def generate(source: str, target: str) -> str:
    """The blocking twin of ``PACKAGE/source``, as it should be checked in at ``PACKAGE/target``."""
    text = header(source) + unasync((PACKAGE / source).read_text())
    text = _ruff(["check", "--fix-only", "--select", "I,F401", "--quiet"], text, PACKAGE / target)
    return _ruff(["format", "--quiet"], text, PACKAGE / target)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a checked-in twin is stale")
    args = parser.parse_args()
    stale = []
    for source, target in TWINS.items():
        fresh = generate(source, target)
        path = PACKAGE / target
        if args.check:
            if not path.exists() or path.read_text() != fresh:
                stale.append(target)
        else:
            path.write_text(fresh)
    if stale:
        print(f"stale generated client: {stale}; run: ./dev unasync", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
