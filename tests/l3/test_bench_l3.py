"""The L3 benchmark's parts run end to end on a few pages (figures are not asserted)."""

from __future__ import annotations

from pathlib import Path

from hicached.bench import l3 as bench


def test_paired_file_runs_report_every_figure(tmp_path: Path) -> None:
    pages = bench._Pages(64)
    figures = bench._paired_file_runs(pages, tmp_path, reps=2)
    assert set(figures) == {
        "disk_write_gbps",
        "disk_read_gbps",
        "l3_file_write_gbps",
        "l3_file_read_gbps",
        "l3_file_write_vs_disk",
        "l3_file_read_vs_disk",
    }
    assert all(v > 0 for v in figures.values())
    assert list(tmp_path.iterdir()) == []  # scratch removed
    per_page = bench._per_page_files(bench._Pages(16, pages.source), tmp_path / "pp")
    assert per_page["l3_file_per_page_write_gbps"] > 0


def test_restore_through_the_index_reports_its_ratio(tmp_path: Path) -> None:
    """The cold-prefix restore (L3 -> L2 -> worker) runs beside raw disk and checks the bytes the
    worker received against what was backed up (a wrong page raises instead of reporting)."""
    pages = bench._Pages(200)  # not a multiple of the batch: the last batch is partial
    with bench.host_group(pages.n) as group:
        figures = bench._paired_file_runs(pages, tmp_path, reps=3, group=group)
        assert figures["l3_restore_gbps"] > 0
        assert figures["l3_restore_vs_disk"] > 0
        assert group.anchor.host_pool.allocator.available() == pages.n  # every L2 page back
    assert list(tmp_path.iterdir()) == []


def test_redis_figures(tmp_path: Path) -> None:
    figures = bench._redis(bench._Pages(64), tmp_path)
    assert set(figures) == {"redis_set_gbps", "redis_get_gbps", "l3_redis_set_gbps", "l3_redis_get_gbps"}
    assert all(v > 0 for v in figures.values())
