"""Benchmarks: each module's ``run(quick: bool) -> dict[str, float]`` measures the daemon
beside the machine's own limit in the same run and prints nothing (``hicached bench`` prints)."""
