"""The file backend's sequence numbers at start: a slot header numbered far past the store's own.

The numbers order the copies of a key and the LRU order at start, and the counter goes on from the
highest one found. Before, a header that verified with a number at or just below ``MAX_SEQ`` (planted
by whoever can write the directory, or written by another program) was indexed and the counter
followed it: the pages written next got numbers above ``MAX_SEQ``, which the next start refuses as
corrupt, so every page written after it was dropped, and its slot cleared, at every restart.

Headers are planted with the layout's own ``pack_header`` into the slab file of a real backend
directory, between a close and an open of the backend.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hicached.l3.file import HEADER_BYTES, slot_bytes_for
from hicached.l3.file.index import RENUMBER_ABOVE
from hicached.l3.file.layout import MAX_SEQ, pack_header, parse_header
from hicached.l3.framing import payload_checksum

from .test_file import open_file, page, slab_path

SLOT = slot_bytes_for(4096)


def plant(
    root: Path, slot: int, key: str, seq: int, data: bytes, *, length: int = 4096, checksum: int | None = None
) -> None:
    """Write a page into ``slot`` as the backend would, with the header fields given."""
    checksum = payload_checksum([data]) if checksum is None else checksum
    with slab_path(root).open("r+b") as f:
        f.seek(slot * SLOT)
        f.write(pack_header(key.encode(), seq, length, checksum) + data)


def numbers(root: Path) -> dict[str, int]:
    """Key -> sequence number of every valid header in the 4 KiB pages' slab file."""
    found: dict[str, int] = {}
    raw = slab_path(root).read_bytes()
    for offset in range(0, len(raw), SLOT):
        parsed = parse_header(raw[offset : offset + HEADER_BYTES])
        if parsed is not None:
            found[parsed[0]] = parsed[1]
    return found


def write_two(root: Path) -> None:
    with open_file(root) as backend:
        assert backend.set(["s/a", "s/b"], [page("s/a"), page("s/b")]) == [True, True]


@pytest.mark.parametrize("seq", [MAX_SEQ, MAX_SEQ - 1, RENUMBER_ABOVE + 1])
def test_pages_written_after_a_header_numbered_near_the_end_survive_restarts(
    file_dir: Path, seq: int
) -> None:
    write_two(file_dir)
    plant(file_dir, 2, "s/planted", seq, page("s/planted"))
    with open_file(file_dir) as backend:
        assert backend.get(["s/planted"]) == [page("s/planted")]
        assert backend.set(["s/c", "s/d"], [page("s/c"), page("s/d")]) == [True, True]
    keys = ["s/a", "s/b", "s/planted", "s/c", "s/d"]
    with open_file(file_dir) as backend:
        assert backend.get(keys) == [page(k) for k in keys]
        assert backend.stats().corrupt_pages == 0
        assert backend.set(["s/e"], [page("s/e")]) == [True]
    with open_file(file_dir) as backend:
        assert backend.get([*keys, "s/e"]) == [page(k) for k in [*keys, "s/e"]]
    assert numbers(file_dir) == {k: n for n, k in enumerate([*keys, "s/e"], start=1)}


def test_renumbering_keeps_write_order_and_lru_order(file_dir: Path) -> None:
    """The numbers are rewritten 1, 2, ... in their old order: the LRU order at start follows it."""
    write_two(file_dir)
    plant(file_dir, 2, "s/planted", MAX_SEQ, page("s/planted"))
    with open_file(file_dir, capacity=3 * SLOT) as backend:
        assert numbers(file_dir) == {"s/a": 1, "s/b": 2, "s/planted": 3}
        assert backend.set(["s/c"], [page("s/c")]) == [True]  # evicts the oldest, s/a
        assert backend.present(["s/a", "s/b", "s/planted", "s/c"]) == [False, True, True, True]
    assert numbers(file_dir) == {"s/b": 2, "s/planted": 3, "s/c": 4}


def test_renumbering_keeps_the_newer_copy_of_a_key(file_dir: Path) -> None:
    """Two copies of a key (a clear of the older one that did not reach the disk): the older one's
    header is cleared before the newer one gets its low number, or it would win at the next start."""
    old, new = page("s/old"), page("s/new")
    write_two(file_dir)
    plant(file_dir, 2, "s/k", MAX_SEQ - 1, old)
    plant(file_dir, 3, "s/k", MAX_SEQ, new)
    with open_file(file_dir) as backend:
        assert backend.get(["s/k"]) == [new]
    with open_file(file_dir) as backend:
        assert backend.get(["s/k"]) == [new]
        assert backend.stats().pages == 3
    assert numbers(file_dir) == {"s/a": 1, "s/b": 2, "s/k": 3}


def test_numbers_up_to_the_bound_are_not_rewritten(file_dir: Path) -> None:
    """An honest store never comes near :data:`RENUMBER_ABOVE`: its headers are read, not written."""
    write_two(file_dir)
    plant(file_dir, 2, "s/high", RENUMBER_ABOVE, page("s/high"))
    with open_file(file_dir) as backend:
        assert backend.get(["s/high"]) == [page("s/high")]
    assert numbers(file_dir) == {"s/a": 1, "s/b": 2, "s/high": RENUMBER_ABOVE}


@pytest.mark.parametrize(
    ("length", "checksum", "corrupt"),
    [((1 << 64) - 1, None, 1), (4096, 0x5A5A5A5A5A5A5A5A, 1), (0, None, 1)],
    ids=["wild-length", "wild-checksum", "zero-length"],
)
def test_a_header_with_wild_fields_does_not_cost_later_pages(
    file_dir: Path, length: int, checksum: int | None, corrupt: int
) -> None:
    """Wild length or checksum beside a number at the end: a length the slot cannot hold is
    dropped at start, a wrong checksum at its first read; the pages written after it stay."""
    write_two(file_dir)
    plant(file_dir, 2, "s/wild", MAX_SEQ, page("s/wild"), length=length, checksum=checksum)
    with open_file(file_dir) as backend:
        assert backend.get(["s/wild"]) == [None]
        assert backend.stats().corrupt_pages == corrupt
        assert backend.set(["s/c"], [page("s/c")]) == [True]
    with open_file(file_dir) as backend:
        assert backend.get(["s/a", "s/b", "s/c", "s/wild"]) == [page("s/a"), page("s/b"), page("s/c"), None]
        assert backend.stats().corrupt_pages == 0
