"""Logging setup: plain text or one JSON object per line (``--log-format json``).

Structured fields are passed with ``extra={...}`` by the callers (for example
``event``, ``session``) and appear as keys of the JSON object, or as ``key=value``
after the message in the text format (see :class:`TextFormatter` for its escaping).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}

# Values come from clients too (an attach's instance_id, model_name): a bound keeps one
# client from making every line it causes kilobytes long.
MAX_VALUE_CHARS = 200
# Characters that would make a bare value ambiguous for a ``key=value`` parser.
_NOT_BARE = frozenset(' ="\\')
# What follows a record's line (a traceback) starts with this, so no such line can pass
# for the start of a record.
CONTINUATION = "    "


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def escape_controls(text: str) -> str:
    """``text`` with every non-printable character (``str.isprintable``: C0/C1 controls
    such as newline, CR, tab and ESC, DEL, U+2028/U+2029, other separators and format
    characters) written as its Python escape (``\\n``, ``\\x1b``, ``\\u2028``); the rest,
    backslashes included, unchanged. Readable, one line, but not reversible."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def format_value(value: object) -> str:
    """One ``extra`` value as the text format writes it after ``key=``.

    ``str(value)`` longer than :data:`MAX_VALUE_CHARS` is cut to that many characters
    followed by ``...(N more chars)``. The result is written bare when it is non-empty,
    printable and holds no space, ``=``, ``"`` or backslash; otherwise as a JSON string
    literal (double quotes, ASCII only, every control and non-ASCII character escaped), so
    ``json.loads`` gives the (possibly cut) value back.
    """
    text = str(value)
    if len(text) > MAX_VALUE_CHARS:
        text = f"{text[:MAX_VALUE_CHARS]}...({len(text) - MAX_VALUE_CHARS} more chars)"
    if text and text.isprintable() and _NOT_BARE.isdisjoint(text):
        return text
    return json.dumps(text)


class TextFormatter(logging.Formatter):
    """``<asctime> <LEVEL> <logger>: <message> key=value ...``, one line per record.

    A log line is always one line of printable text, whatever a client sent: the message
    goes through :func:`escape_controls` (it may interpolate client text with ``%s``), and
    every ``extra`` value through :func:`format_value` (bare, or a JSON string literal when
    it starts with ``"``). A traceback or stack follows on lines of its own, each escaped
    and indented by :data:`CONTINUATION`; so every line that does not start with a space
    starts a record.
    """

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(_head_only(record))
        fields = [
            f"{k}={format_value(v)}"
            for k, v in vars(record).items()
            if k not in _STANDARD and not k.startswith("_")
        ]
        if fields:
            line = f"{line} {' '.join(fields)}"
        return line + "".join(f"\n{CONTINUATION}{escape_controls(extra)}" for extra in self._trailer(record))

    def _trailer(self, record: logging.LogRecord) -> list[str]:
        """The lines of the record's traceback and stack, as the base formatter writes them."""
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)  # cached, as the base does
        lines = record.exc_text.split("\n") if record.exc_text else []
        if record.stack_info:
            lines += self.formatStack(record.stack_info).split("\n")
        return lines


def _head_only(record: logging.LogRecord) -> logging.LogRecord:
    """A copy of ``record`` with its message already formatted and escaped (``args`` gone, so
    a ``%`` in it stays as it is) and no traceback or stack: those are written apart."""
    head = {**vars(record), "msg": escape_controls(record.getMessage()), "args": None}
    return logging.makeLogRecord(head | {"exc_info": None, "exc_text": None, "stack_info": None})


class SiteRateLimit(logging.Filter):
    """At most ``rate`` records per second from each logging call site below ERROR, with a
    burst of ``BURST_SECONDS`` seconds' worth; the rest are dropped and counted, and the
    site's next record written carries ``dropped=N`` (so nothing goes unnoticed).

    Why: clients cause log lines (each attach and detach writes one), and a client looping
    on them would otherwise fill the disk and drown everyone else's lines. Keyed by the
    call site (file and line; for gRPC's own records also the start of the message, see
    :meth:`_site`), at most ``MAX_SITES`` buckets whatever clients send. ERROR and above always pass, except gRPC's own (loggers ``grpc...``): gRPC
    logs an ERROR with a traceback when a client is gone before its answer is sent
    (``ExecuteBatchError``), so a client cancelling calls in a loop could write them without
    bound. Thread-safe (one lock; a few dict operations).
    """

    BURST_SECONDS = 10.0
    MAX_SITES = 4096  # buckets kept; grpc's sites include a prefix of their text (below)

    @staticmethod
    def _site(record: logging.LogRecord) -> tuple[str, int, str]:
        """The call site of ``record``. gRPC's aio records all come from one line of asyncio's,
        so theirs adds the first 24 characters of the message (the kind of error): a flood of
        one kind (``ExecuteBatchError``) then does not silence another."""
        if record.name.startswith("grpc"):
            return record.pathname, record.lineno, str(record.msg)[:24]
        return record.pathname, record.lineno, ""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._rate = rate
        self._burst = max(1.0, rate * self.BURST_SECONDS)  # below 0.1/s a smaller burst passed nothing
        self._clock = clock
        self._lock = threading.Lock()
        self._sites: dict[tuple[str, int, str], list[float]] = {}  # site -> [tokens, last time, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and not record.name.startswith("grpc"):
            return True
        now = self._clock()
        key = self._site(record)
        with self._lock:
            site = self._sites.get(key)
            if site is None:
                if len(self._sites) >= self.MAX_SITES:
                    key = ("", 0, "")  # one shared bucket past the bound
                site = self._sites.setdefault(key, [self._burst, now, 0])
            tokens = min(self._burst, site[0] + (now - site[1]) * self._rate)
            site[1] = now
            if tokens < 1:
                site[0] = tokens
                site[2] += 1
                return False
            site[0] = tokens - 1
            dropped, site[2] = int(site[2]), 0
        if dropped:
            record.dropped = dropped
        return True


def setup_logging(level: str, fmt: str, max_rate: float = 0.0) -> None:
    """Log to stderr at ``level`` in ``fmt`` (text or json), at most ``max_rate`` records per
    second per call site below ERROR (:class:`SiteRateLimit`; 0: no limit)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        JsonFormatter() if fmt == "json" else TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    if max_rate > 0:
        handler.addFilter(SiteRateLimit(max_rate))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
