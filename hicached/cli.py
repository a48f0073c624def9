"""The ``hicached`` command line (placeholder until the server lands)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hicached", description="HiCache tiering daemon")
    parser.add_subparsers(dest="command")
    parser.parse_args(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
