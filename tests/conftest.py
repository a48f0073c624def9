"""The fixture most test modules share: one real daemon per module, with the suite's
defaults (:func:`tests.support.daemon.start_daemon`). A module that needs other flags
defines its own ``daemon``, which takes precedence."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.daemon import Daemon, start_daemon


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    d = start_daemon()
    try:
        yield d
    finally:
        d.stop()
