"""Hypothesis strategies built from the proto descriptors (tests/robustness/test_fuzz.py):
every field of a request message, biased towards hostile values, and raw bytes that no
request message decodes from. Also the fuzz's tally (cases tried, codes seen per RPC)."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from google.protobuf import descriptor as d
from google.protobuf import message_factory
from google.protobuf.message import DecodeError, Message
from hypothesis import strategies as st

MAX_DEPTH = 3
INT32 = (0, 1, -1, 2**31 - 1, -(2**31))
INT64 = (*INT32, 2**63 - 1, -(2**63), 2**53 + 1)
UINT32 = (0, 1, 2**31, 2**32 - 1)
UINT64 = (*UINT32, 2**63, 2**64 - 1)
FLOATS = (0.0, -0.0, math.nan, math.inf, -math.inf, 1e308, -1.0, 1e-300)
NASTY_TEXT = (
    "",
    " ",
    "\x00",
    "../../etc/passwd",
    "é" * 3,
    "\u202e\U0001f600",
    "a" * 4096,
    "k" * 70_000,  # longer than any identity or key limit, far below the message limit
    "kv",
    "swa",
    "draft",
)


def _ints(values: Sequence[int], lo: int, hi: int) -> st.SearchStrategy[int]:
    # Small values hit real page indices and counts; the extremes hit the edges.
    small = st.integers(0, 80)  # twice: most values are plausible pages/counts
    return st.one_of(small, st.sampled_from(values), small, st.integers(lo, hi))


SCALARS: dict[int, st.SearchStrategy[Any]] = {
    d.FieldDescriptor.TYPE_INT32: _ints(INT32, -(2**31), 2**31 - 1),
    d.FieldDescriptor.TYPE_SINT32: _ints(INT32, -(2**31), 2**31 - 1),
    d.FieldDescriptor.TYPE_SFIXED32: _ints(INT32, -(2**31), 2**31 - 1),
    d.FieldDescriptor.TYPE_INT64: _ints(INT64, -(2**63), 2**63 - 1),
    d.FieldDescriptor.TYPE_SINT64: _ints(INT64, -(2**63), 2**63 - 1),
    d.FieldDescriptor.TYPE_SFIXED64: _ints(INT64, -(2**63), 2**63 - 1),
    d.FieldDescriptor.TYPE_UINT32: _ints(UINT32, 0, 2**32 - 1),
    d.FieldDescriptor.TYPE_FIXED32: _ints(UINT32, 0, 2**32 - 1),
    d.FieldDescriptor.TYPE_UINT64: _ints(UINT64, 0, 2**64 - 1),
    d.FieldDescriptor.TYPE_FIXED64: _ints(UINT64, 0, 2**64 - 1),
    d.FieldDescriptor.TYPE_BOOL: st.booleans(),
    d.FieldDescriptor.TYPE_DOUBLE: st.one_of(st.sampled_from(FLOATS), st.floats()),
    d.FieldDescriptor.TYPE_FLOAT: st.one_of(st.sampled_from(FLOATS[:5]), st.floats(width=32, allow_nan=True)),
    d.FieldDescriptor.TYPE_BYTES: st.one_of(st.binary(max_size=64), st.just(b""), st.just(b"\xff" * 100_000)),
}


def text(known: Sequence[str]) -> st.SearchStrategy[str]:
    """Known-good values (a live session id, a pool name) mixed with hostile ones."""
    return st.one_of(
        st.sampled_from([*known, *NASTY_TEXT]),
        st.text(max_size=40),
        st.text(alphabet=st.characters(codec="utf-8"), min_size=1, max_size=8),
    )


def field_value(field: d.FieldDescriptor, known: dict[str, Sequence[str]], depth: int) -> Any:
    """A strategy for one value of ``field`` (a message as a dict of field -> value)."""
    if field.type == d.FieldDescriptor.TYPE_MESSAGE:
        return message_fields(field.message_type, known, depth + 1)
    if field.type == d.FieldDescriptor.TYPE_ENUM:
        numbers = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(numbers), st.sampled_from([-1, 99, 2**31 - 1]))
    if field.type == d.FieldDescriptor.TYPE_STRING:
        good = known.get(field.name, ())
        # Mostly the real value (a live session id reaches the handler's checks), else garbage.
        if not good:
            return text(())
        return st.integers(0, 4).flatmap(lambda i: st.sampled_from(good) if i else text(good))
    return SCALARS[field.type]


def _repeated(field: d.FieldDescriptor, known: dict[str, Sequence[str]], depth: int) -> Any:
    one = field_value(field, known, depth)
    if field.type in (d.FieldDescriptor.TYPE_MESSAGE, d.FieldDescriptor.TYPE_STRING):
        return st.one_of(st.lists(one, max_size=4), st.lists(one, min_size=600, max_size=700))
    # Long numeric lists: past the daemon's pages-per-request limit.
    return st.one_of(
        st.lists(one, max_size=8),
        st.lists(st.integers(0, 63), min_size=1, max_size=20),
        st.just([0] * 5000),
        st.lists(one, min_size=600, max_size=700),
    )


@st.composite
def message_fields(
    draw: st.DrawFn,
    desc: d.Descriptor,
    known: dict[str, Sequence[str]],
    depth: int = 0,
    shape: int | None = -1,
) -> dict[str, Any]:
    """A random subset of ``desc``'s fields, each with a hostile or plausible value.

    Half the requests are *shaped*: every repeated scalar field, nested ones included, has
    the same length (pages and keys of one call agree), so values get past the length checks
    into the handler's deeper ones (ranges, ownership)."""
    out: dict[str, Any] = {}
    if depth > MAX_DEPTH:
        return out
    if shape == -1:
        shape = draw(st.one_of(st.none(), st.sampled_from([1, 2, 4, 8])), label="shape")
    # One member per oneof (setting two keeps only the last: the first would never be sent).
    chosen = {
        o.name: draw(st.sampled_from([f.name for f in o.fields])) for o in desc.oneofs if len(o.fields) > 1
    }
    for field in desc.fields:
        group = field.containing_oneof
        if group is not None and group.name in chosen and chosen[group.name] != field.name:
            continue
        if field.name not in known and draw(st.integers(0, 3)) == 0:
            continue  # a field with a known-good value is always set (mostly to that value)
        if field.is_repeated:
            if field.type == d.FieldDescriptor.TYPE_MESSAGE and depth >= MAX_DEPTH - 1:
                continue  # bounded size: long lists only near the top
            if shape is None:
                out[field.name] = draw(_repeated(field, known, depth))
            elif field.type == d.FieldDescriptor.TYPE_MESSAGE:
                item = message_fields(field.message_type, known, depth + 1, shape)
                out[field.name] = draw(st.lists(item, min_size=1, max_size=2))
            else:
                one = field_value(field, known, depth)
                out[field.name] = draw(st.lists(one, min_size=shape, max_size=shape))
        elif field.type == d.FieldDescriptor.TYPE_MESSAGE:
            out[field.name] = draw(message_fields(field.message_type, known, depth + 1, shape))
        else:
            out[field.name] = draw(field_value(field, known, depth))
    return out


def build(desc: d.Descriptor, fields: dict[str, Any]) -> Message:
    cls = message_factory.GetMessageClass(desc)
    msg = cls()
    _fill(msg, fields)
    return msg


def _fill(msg: Message, fields: dict[str, Any]) -> None:
    for name, value in fields.items():
        field = msg.DESCRIPTOR.fields_by_name[name]
        if field.type == d.FieldDescriptor.TYPE_MESSAGE:
            if field.is_repeated:
                for item in value:
                    _fill(getattr(msg, name).add(), item)
            else:
                getattr(msg, name).SetInParent()
                _fill(getattr(msg, name), value)
        elif field.is_repeated:
            getattr(msg, name).extend(value)
        else:
            setattr(msg, name, value)


# Bytes no request message decodes from: a truncated varint, a length past the end, an
# invalid tag (field 0), a deprecated group start, invalid UTF-8 in field 1 (a string in
# every request: session_id or op_id or model name).
UNDECODABLE_TAILS = (
    b"\x08\xff\xff\xff",
    b"\x0a\xff\xff\xff\x0f",
    b"\x00\x01",
    b"\x0b",
    b"\x0a\x02\xff\xfe",
)


@st.composite
def undecodable(draw: st.DrawFn, desc: d.Descriptor) -> bytes:
    """Raw request bytes that the request class of ``desc`` refuses to parse."""
    cls = message_factory.GetMessageClass(desc)
    prefix = draw(st.sampled_from([b"", b"\x10\x01", b"\x18\x05"]))
    payload = prefix + draw(st.sampled_from(UNDECODABLE_TAILS))
    for candidate in (payload, *UNDECODABLE_TAILS):
        try:
            cls.FromString(candidate)
        except DecodeError:
            return candidate
    raise AssertionError(f"{desc.name} decodes every candidate")  # a truncated varint never does


def decodes(desc: d.Descriptor, payload: bytes) -> bool:
    try:
        message_factory.GetMessageClass(desc).FromString(payload)
    except DecodeError:
        return False
    return True


class Tally:
    """Cases tried and gRPC codes seen, per RPC; written as JSON and shown in the summary."""

    def __init__(self) -> None:
        self.codes: dict[str, Counter[str]] = {}

    def add(self, rpc: str, code: str) -> None:
        self.codes.setdefault(rpc, Counter())[code] += 1

    @property
    def cases(self) -> int:
        return sum(sum(c.values()) for c in self.codes.values())

    def totals(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for c in self.codes.values():
            out.update(c)
        return out

    def lines(self) -> list[str]:
        out = [f"fuzz: {self.cases} cases over {len(self.codes)} RPC kinds; codes {dict(self.totals())}"]
        out += [f"  {rpc}: {dict(c)}" for rpc, c in sorted(self.codes.items())]
        return out

    def write(self, path: Path) -> None:
        path.write_text(json.dumps({rpc: dict(c) for rpc, c in self.codes.items()}, indent=1))


TALLY = Tally()
