"""What two successive daemons share for a warm restart: a shm prefix and a journal directory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tests.support.daemon import Daemon, start_daemon


@dataclass
class Warm:
    """The shm prefix and journal directory two successive daemons share."""

    prefix: str
    journal_dir: Path

    def start(self) -> Daemon:
        return self.start_with()

    def start_with(self, *extra: str) -> Daemon:
        return start_daemon(
            "--set", "host.warm_restart=true",
            "--set", f"host.journal_dir={self.journal_dir}",
            "--set", f"host.shm_prefix={self.prefix}",
            *extra,
        )  # fmt: skip

    def segments(self) -> set[str]:
        return {p.name for p in Path("/dev/shm").glob(f"{self.prefix}-*")}

    def journals(self) -> list[Path]:
        return sorted(self.journal_dir.glob(f"{self.prefix}-*.json"))
