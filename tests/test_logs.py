"""The text log format keeps one record on one line of printable text whatever a client
sends: ``extra`` values and the message are escaped, long values are cut and marked, and
plain values (ids, numbers) are written as they are.

On the code before, a value with a newline wrote a second line that passed for a record of
its own (a forged CRITICAL), and CR, ESC and U+2028 reached the log raw.
"""

from __future__ import annotations

import json
import logging
import re
import sys

from hicached.logs import MAX_VALUE_CHARS, SiteRateLimit, TextFormatter

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FORGED = "w1\n2026-12-06 02:00:00,000 CRITICAL hicached.daemon: FORGED event=forged"
HOSTILE = FORGED + "\r\x1b[31mRED\t\x7f\x85\u2028\u2029\u202e end"
# What a parser of the text format may rely on: a bare value, or a JSON string literal.
FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|[^ "]+)')
RECORD_START = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ ")


def render(msg: str = "session attached", *args: object, **extra: object) -> str:
    exc_info = sys.exc_info() if sys.exc_info()[0] else None
    record = logging.getLogger("hicached.test").makeRecord(
        "hicached.test", logging.INFO, __file__, 1, msg, args, exc_info, extra=extra
    )
    return TextFormatter(FORMAT).format(record)


def fields(line: str) -> dict[str, str]:
    """The ``key=value`` pairs after the message, each value as it was logged."""
    found = {}
    for key, raw in FIELD.findall(line):
        found[key] = json.loads(raw) if raw.startswith('"') else raw
    return found


def assert_one_printable_line(text: str) -> None:
    assert len(text.splitlines()) == 1, ascii(text[:500])  # splitlines: \r, \x85, U+2028 and more break too
    assert text.isprintable(), ascii(text[:500])


def test_a_hostile_value_is_one_printable_line_and_comes_back_whole() -> None:
    line = render(event="attach", instance=HOSTILE, model="m\rX\x1b[31mRED")
    assert_one_printable_line(line)
    got = fields(line)
    assert got["instance"] == HOSTILE and got["model"] == "m\rX\x1b[31mRED", line
    assert got["event"] == "attach"


def test_plain_values_are_written_as_they_are() -> None:
    line = render(event="attach", session="s-1f2e", generation=3, peer_uid=None, path="/tmp/x/d.sock")
    assert line.endswith(
        ": session attached event=attach session=s-1f2e generation=3 peer_uid=None path=/tmp/x/d.sock"
    )


def test_a_value_with_spaces_or_equals_is_quoted() -> None:
    line = render(event="started", tcp="127.0.0.1:5 auth=token tls=off", empty="")
    assert 'tcp="127.0.0.1:5 auth=token tls=off"' in line and 'empty=""' in line, line
    assert fields(line)["tcp"] == "127.0.0.1:5 auth=token tls=off"


def test_a_long_value_is_cut_and_marked() -> None:
    line = render(event="attach", instance="\n" + "x" * 100_000)
    assert_one_printable_line(line)
    value = fields(line)["instance"]
    assert value == "\n" + "x" * (MAX_VALUE_CHARS - 1) + "...(99801 more chars)", value
    assert len(line) < 1000, len(line)


def test_client_text_in_the_message_is_escaped() -> None:
    line = render("attach refused for %s", HOSTILE, event="attach")
    assert_one_printable_line(line)
    assert "w1\\n2026-12-06 02:00:00,000 CRITICAL" in line and "\\x1b[31mRED" in line, line
    assert line.endswith(" event=attach"), line


def test_a_traceback_cannot_start_a_record() -> None:
    try:
        raise ValueError(HOSTILE)
    except ValueError:
        text = render("step failed", event="task_failed")
    first, *rest = text.split("\n")
    assert RECORD_START.match(first) and rest, text
    for line in rest:  # the exception's own newline still breaks its traceback: indented
        assert line.startswith("    ") and line.isprintable(), ascii(line)
    assert any(line.startswith("    2026-12-06 02:00:00,000 CRITICAL") for line in rest), text


def _record(line: int, level: int = logging.INFO) -> logging.LogRecord:
    return logging.getLogger("hicached.test").makeRecord(
        "hicached.test", level, __file__, line, "session attached", (), None
    )


def test_each_call_site_is_rate_limited_and_says_what_it_dropped() -> None:
    now = [0.0]
    limit = SiteRateLimit(2.0, clock=lambda: now[0])  # 2 lines/s, a burst of 20
    passed = [limit.filter(_record(10)) for _ in range(25)]
    assert passed == [True] * 20 + [False] * 5
    assert limit.filter(_record(11))  # another call site has its own budget
    assert limit.filter(_record(10, logging.ERROR))  # errors always pass
    now[0] = 0.5  # one token back
    record = _record(10)
    assert limit.filter(record) and record.dropped == 5  # type: ignore[attr-defined]
    assert not limit.filter(_record(10))
    now[0] = 1.0
    again = _record(10)
    assert limit.filter(again) and again.dropped == 1  # type: ignore[attr-defined]
    now[0] = 100.0  # refilled to the burst, no more
    assert [limit.filter(_record(10)) for _ in range(21)] == [True] * 20 + [False]


def test_grpcs_own_errors_are_rate_limited_too() -> None:
    """Fails before: every ERROR passed, and gRPC writes one with a traceback for each answer
    whose client was gone (``ExecuteBatchError``): a client cancelling calls in a loop wrote
    them without bound (15 in a review's storm)."""
    limit = SiteRateLimit(2.0, clock=lambda: 0.0)  # a burst of 20
    grpc_log = logging.getLogger("grpc._cython.cygrpc")
    records = [
        grpc_log.makeRecord(grpc_log.name, logging.ERROR, "cygrpc", 7, "ExecuteBatchError", (), None)
    ] * 25
    assert [limit.filter(r) for r in records] == [True] * 20 + [False] * 5
    assert limit.filter(_record(10, logging.ERROR))  # the daemon's own errors always pass
    # gRPC's aio records all come from one line of asyncio's: another kind has its own budget.
    other = grpc_log.makeRecord(
        grpc_log.name, logging.ERROR, "cygrpc", 7, "Unexpected [ValueError]", (), None
    )
    assert limit.filter(other)


def test_a_rate_below_one_line_per_burst_still_lets_lines_through() -> None:
    now = [0.0]
    limit = SiteRateLimit(0.05, clock=lambda: now[0])  # a 10 s burst of 0.5 lines: rounded up to 1
    assert limit.filter(_record(10))
    assert not limit.filter(_record(10))
    now[0] = 20.0
    assert limit.filter(_record(10))
