"""A periodic background task never dies silently: a failing step is logged with its
traceback, counted and retried with backoff; a fatal task stops instead of retrying."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from hicached.errors import Unavailable
from hicached.tasks import supervise


def _until_steady(name: str, errors: list[Exception], **options: Any) -> int:
    """Supervise a step that raises ``errors`` in turn, then succeeds; the steps it took."""
    calls: list[int] = []

    async def main() -> None:
        done = asyncio.Event()

        def step() -> None:
            calls.append(1)
            if len(calls) <= len(errors):
                raise errors[len(calls) - 1]
            done.set()

        task = asyncio.create_task(supervise(name, step, interval_s=0.001, max_backoff_s=0.01, **options))
        await asyncio.wait_for(done.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    return len(calls)


def test_failing_step_is_logged_with_traceback_and_retried(caplog: pytest.LogCaptureFixture) -> None:
    failures: list[str] = []
    with caplog.at_level(logging.INFO, logger="hicached.tasks"):
        steps = _until_steady("gauges", [KeyError("boom 1"), KeyError("boom 2")], on_failure=failures.append)
    assert steps == 3 and failures == ["gauges", "gauges"]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2 and all(r.exc_info is not None for r in errors)
    assert "boom 1" in caplog.text and "Traceback" in caplog.text
    assert any("recovered after 2 failures" in r.getMessage() for r in caplog.records)


def test_an_expected_failure_is_one_line_naming_it(caplog: pytest.LogCaptureFixture) -> None:
    """Fails before: an L3 outage (Unavailable) was logged with its chained traceback at every
    retry of the L3 stats task (~90 lines each); it is a message, not a programming error."""
    with caplog.at_level(logging.INFO, logger="hicached.tasks"):
        steps = _until_steady("l3_stats", [Unavailable("redis server at 127.0.0.1:6379/0 is unreachable")])
    assert steps == 2
    (error,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert not error.exc_info
    assert "is unreachable" in error.getMessage() and "Traceback" not in caplog.text


def test_fatal_task_calls_on_fatal_once_and_ends() -> None:
    seen: list[tuple[str, str]] = []

    def step() -> None:
        raise RuntimeError("state is wrong")

    async def main() -> None:
        await asyncio.wait_for(
            supervise(
                "journal",
                step,
                interval_s=0.001,
                fatal=True,
                on_fatal=lambda name, exc: seen.append((name, str(exc))),
            ),
            10,
        )

    asyncio.run(main())
    assert seen == [("journal", "state is wrong")]
