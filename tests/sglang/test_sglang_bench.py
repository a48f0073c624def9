"""The ``sglang`` bench suite at tiny sizes: every figure of issue 12's table is produced from one
run, the ratios are the figures' quotients, and ``hicached bench`` prints each beside its limit
and target. Shape only: performance is the bench's business, never asserted here."""

from __future__ import annotations

import pytest

from hicached.bench import sglang
from hicached.commands.bench import RATIOS

FIGURES = (
    "hicached_set",
    "hicached_warm_get",
    "hicached_cold_get",
    "file_set",
    "file_hot_get",
    "file_cold_get",
    "disk_write",
    "disk_cold_read",
)
RATIO_KEYS = {
    "sglang_set_vs_file": ("hicached_set", "file_set"),
    "sglang_cold_get_vs_file": ("hicached_cold_get", "file_cold_get"),
    "sglang_warm_get_vs_file": ("hicached_warm_get", "file_hot_get"),
    "sglang_cold_get_vs_disk": ("hicached_cold_get", "disk_cold_read"),
}


def test_the_suite_reports_set_cold_and_warm_get_against_hicachefile_and_the_disk() -> None:
    # The suite raises when a read differs byte for byte or hicached did not take the zero-copy path.
    got = sglang.run(quick=True, pages=16, pages_1m=0, rounds=1)
    for fig in FIGURES:
        assert got[f"sglang_{fig}_gbps"] > 0, fig
        assert f"sglang_{fig}_gbps_1m" not in got  # 0 pages leaves the size out
    for key, (fig, base) in RATIO_KEYS.items():
        assert got[key] == pytest.approx(got[f"sglang_{fig}_gbps"] / got[f"sglang_{base}_gbps"]), key
    assert got["sglang_pages"] == 16 and got["sglang_page_bytes"] == 64 << 10


def test_every_ratio_is_printed_beside_its_limit_with_the_issue_target() -> None:
    rows = {(fig, lim): meaning for fig, lim, meaning in RATIOS}
    for sfx in ("", "_1m"):
        for fig, base in RATIO_KEYS.values():
            meaning = rows[(f"sglang_{fig}_gbps{sfx}", f"sglang_{base}_gbps{sfx}")]
            assert "target >=" in meaning
    assert "target >= 3" in rows[("sglang_hicached_set_gbps", "sglang_file_set_gbps")]
    assert "target >= 2" in rows[("sglang_hicached_set_gbps_1m", "sglang_file_set_gbps_1m")]


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        sglang.run(quick=True, pages=-1, rounds=1)
