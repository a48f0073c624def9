"""The remote-L3 benchmark runs end to end on a few pages (figures are not asserted)."""

from __future__ import annotations

from pathlib import Path

from hicached.bench import l3_remote


def test_every_figure_is_reported_and_scratch_removed(tmp_path: Path) -> None:
    figures = l3_remote.run(quick=True, workdir=tmp_path, pages_count=32)
    assert set(figures) == {
        "s3_raw_put_gbps",
        "s3_raw_get_gbps",
        "s3_1mib_raw_put_gbps",
        "s3_put_gbps",
        "s3_get_gbps",
        "mooncake_raw_put_gbps",
        "mooncake_raw_get_gbps",
        "mooncake_put_gbps",
        "mooncake_get_gbps",
    }
    assert all(v > 0 for v in figures.values())
    assert list(tmp_path.iterdir()) == []
