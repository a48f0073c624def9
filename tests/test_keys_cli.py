"""``hicached keys`` run as a real subprocess."""

from __future__ import annotations

import subprocess
import sys

from hicached.page_keys import page_keys


def hicached(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hicached", "keys", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_prints_one_key_per_page() -> None:
    out = hicached("--page-size", "2", "--tokens", "1,2,3")
    assert out.returncode == 0, out.stderr
    # Independent vectors (sha256sum over hand-written bytes, see tests/l3/test_keys.py).
    assert out.stdout.splitlines() == [
        "34fb5c825de7ca4aea6e712f19d439c1da0c92c37b423936c5f618545ca4fa1f",
        "3ac5d352be720e428633fe34fc74591b2b80060a7764e195d8f34068203ae98f",
    ]


def test_namespace_and_full_pages_only() -> None:
    out = hicached("--page-size", "2", "--tokens", "5, 6,7", "--extra-key", "a", "--cache-salt", "bc")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == page_keys([5, 6, 7], 2, extra_key="a", cache_salt="bc")
    other = hicached("--page-size", "2", "--tokens", "5,6,7", "--extra-key", "ab", "--cache-salt", "c")
    assert set(other.stdout.splitlines()).isdisjoint(out.stdout.splitlines())
    full = hicached("--page-size", "2", "--tokens", "5,6,7", "--full-pages-only")
    assert full.stdout.splitlines() == page_keys([5, 6], 2)


def test_bad_input_exits_2_naming_the_value() -> None:
    out = hicached("--page-size", "2", "--tokens", "1,x2")
    assert out.returncode == 2
    assert "'x2'" in out.stderr and out.stdout == ""
    out = hicached("--page-size", "0", "--tokens", "1")
    assert out.returncode == 2 and "argument --page-size: '0'" in out.stderr
    out = hicached("--page-size", "2", "--tokens", "-1")
    assert out.returncode == 2 and "-1" in out.stderr
