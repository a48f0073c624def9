"""The fastlane bench suite runs end to end and reports every key the issue names
(figures only: performance is measured by ``hicached bench``, never asserted here)."""

from __future__ import annotations

from hicached.bench import fastlane
from hicached.commands.bench import RATIOS, SUITES


def test_the_fastlane_suite_reports_its_figures_beside_the_ping_pong() -> None:
    assert SUITES["fastlane"] == "hicached.bench.fastlane"
    assert ("fastlane_rtt_us", "uds_pingpong_us") in {(f, lim) for f, lim, _ in RATIOS}
    out = fastlane.run(quick=True)
    for key in (
        "fastlane_rtt_us",
        "fastlane_ping_us",
        "uds_pingpong_us",
        "grpc_write_rtt_us",
        "layer_signal_us",
    ):
        assert out[key] > 0, key
