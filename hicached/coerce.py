"""The one typed coercer of configuration values (the daemon's and every L3 backend's).

A value arrives either *typed* (a TOML value, a Python object) or as *text*
(an environment variable, ``--set KEY=VALUE``). Typed values must already have
the field's type (``2.5`` is not silently ``2``, ``true`` is not ``1``); text is
parsed. Two field kinds are marked in the dataclass field's metadata:

* ``parse``: a custom parser (``parse_size``: ``"4GiB"`` / ``1024``), used for
  typed and text values alike.
* ``show``: how a value with a custom parser is written back as text (``config show``).
* ``mode``: a permission mode. Text is always octal (``660``, ``0660`` and
  ``0o660`` are all ``0o660``, as with ``chmod``); a typed integer is taken as
  is and must lie in ``0..0o777`` (write ``0o660`` in TOML).

A field typed with a string enum (``enum.StrEnum``) takes one of its values, spelled
exactly (typed or text alike), and holds the member; :func:`one_of` lists them.

A config dataclass built in Python runs its fields through the same coercer on construction
(:func:`typed_fields`, from its ``__post_init__``): ``L3Config(backend="none")`` holds the
member, ``HostConfig(budget="4GiB")`` the bytes, ``L3Config(backend="nfs")`` is refused.

Errors are :class:`~hicached.errors.InvalidArgument` whose message names the
key (the caller's ``label``), quotes the value and says what is allowed. Pure
functions; thread-safe.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any

from hicached.errors import CLIP_CHARS, InvalidArgument

__all__ = [
    "coerce",
    "format_mode",
    "format_size",
    "format_tenant_uids",
    "one_of",
    "option",
    "parse_mode",
    "parse_size",
    "parse_tenant_uids",
    "type_hints",
]

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_MODE_RE = re.compile(r"^(?:0o|0)?([0-7]{1,3})$", re.IGNORECASE)
_TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")  # a tenant of sessions.tenant_uids
_UID_TEXT = re.compile(r"[0-9]{1,10}")  # a uid of sessions.tenant_uids: ASCII digits, 32 bits at most
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_size(text: str | int) -> int:
    """``"256MiB"`` / ``"4G"`` / ``1024`` -> bytes (binary units); ValueError unless the
    result is a whole number of bytes (``"1.5KiB"`` is 1536, ``"0.0001KiB"`` is refused)."""
    if isinstance(text, bool) or not isinstance(text, int | str):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"negative size: {text}")
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (use e.g. 512MiB, 4GiB, 1048576)")
    unit = (m.group(2) or "").upper().rstrip("B").rstrip("I")
    # Exact arithmetic: "0.0001KiB" is 0.1024 bytes, which float-then-int silently made 0
    # (and a zero host.budget means "use host.budget_fraction").
    size = Fraction(m.group(1)) * _SIZE_UNITS[unit]
    if size.denominator != 1:
        raise ValueError(f"not a whole number of bytes: {text!r} is {float(size):g} bytes")
    return int(size)


def format_size(nbytes: int) -> str:
    """``17179869184`` -> ``"16.0 GiB"`` (for people: one decimal, binary units)."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{nbytes} B"


def parse_tenant_uids(text: str | Mapping[str, Any]) -> Mapping[str, frozenset[int]]:
    """``"team-a=1000,1001; team-b=1002"`` -> ``{"team-a": {1000, 1001}, "team-b": {1002}}``
    (read-only). A mapping (a config built in Python) is checked the same way.

    ValueError naming what is wrong: not text; a tenant not of ``[A-Za-z0-9._-]{1,64}``, listed
    twice, or without uids; a uid that is not a non-negative integer.
    """
    if isinstance(text, Mapping):
        return _checked_tenants(text.items())
    if not isinstance(text, str):
        raise ValueError(f"not text: {text!r:.40}")
    entries = []
    for entry in filter(None, (part.strip() for part in text.split(";"))):
        tenant, sep, uids = (s.strip() for s in entry.partition("="))
        if not sep or not _TENANT_NAME.fullmatch(tenant):
            raise ValueError(
                f"{entry[:40]!r} is not TENANT=UID[,UID...] with a tenant of [A-Za-z0-9._-]{{1,64}}"
            )
        numbers = [u.strip() for u in uids.split(",") if u.strip()]
        if not all(_UID_TEXT.fullmatch(u) for u in numbers):  # isdigit() took Arabic-Indic digits
            raise ValueError(
                f"tenant {tenant[:40]!r}: uids must be non-negative integers (32-bit), got {uids[:40]!r}"
            )
        entries.append((tenant, [int(u) for u in numbers]))
    return _checked_tenants(entries)


def _checked_tenants(entries: Iterable[tuple[object, object]]) -> Mapping[str, frozenset[int]]:
    out: dict[str, frozenset[int]] = {}
    for tenant, uids in entries:
        if not isinstance(tenant, str) or not _TENANT_NAME.fullmatch(tenant):
            raise ValueError(f"{tenant!r:.40} is not a tenant of [A-Za-z0-9._-]{{1,64}}")
        if tenant in out:
            raise ValueError(f"tenant {tenant!r} is listed twice")
        if isinstance(uids, str | bytes) or not isinstance(uids, Iterable):
            raise ValueError(f"tenant {tenant!r}: uids must be a collection of integers, got {uids!r:.40}")
        numbers = list(uids)
        if not numbers or not all(type(u) is int and 0 <= u < 1 << 32 for u in numbers):
            raise ValueError(
                f"tenant {tenant!r}: uids must be non-negative integers (32-bit), got {numbers!r:.40}"
            )
        out[tenant] = frozenset(numbers)
    return types.MappingProxyType(out)


def format_tenant_uids(reserved: Mapping[str, frozenset[int]]) -> str:
    """The text :func:`parse_tenant_uids` reads back to ``reserved``: ``"team-a=1000,1001;team-b=1002"``."""
    return ";".join(f"{tenant}={','.join(map(str, sorted(uids)))}" for tenant, uids in reserved.items())


def parse_mode(value: str | int) -> int:
    """A permission mode: text is octal (``"660"``, ``"0660"``, ``"0o660"``); an int is taken as is."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(value)
    if isinstance(value, str):
        m = _MODE_RE.match(value.strip())
        if m is None:
            raise ValueError(value)
        value = int(m.group(1), 8)
    if not 0 <= value <= 0o777:
        raise ValueError(value)
    return value


def format_mode(mode: int) -> str:
    """``432`` -> ``"0o660"`` (how modes are written back, e.g. by ``config show``)."""
    return f"0o{mode:03o}"


def one_of(choices: type[enum.StrEnum]) -> str:
    """The values of a string enum as help and errors list them: ``"a, b, c"``."""
    return ", ".join(member.value for member in choices)


def type_hints(cls: type[Any]) -> dict[str, Any]:
    """The resolved annotations of a dataclass's fields (string annotations evaluated)."""
    return typing.get_type_hints(cls)


def typed_fields(obj: Any, label: str) -> None:
    """Coerce each field of the frozen dataclass ``obj`` in place, as a TOML file's values are
    (typed, not text); a field holding another dataclass (a backend's table) must hold that
    type, which checked itself when built. For ``__post_init__``: nothing else sees ``obj``
    yet. InvalidArgument naming ``label.field``."""
    hints = type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, tp = getattr(obj, f.name), hints[f.name]
        key = f"{label}.{f.name}" if label else f.name
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            if not isinstance(value, tp):
                raise InvalidArgument(f"invalid {key} = {value!r:.60}: expected a {tp.__name__}")
            continue
        out = coerce(value, tp, label=key, metadata=f.metadata)
        if out is not value:
            object.__setattr__(obj, f.name, out)  # frozen: only while it is being built


def _describe(tp: Any, meta: typing.Mapping[str, Any]) -> str:
    if meta.get("mode"):
        return "an octal permission mode such as 0o660 (TOML) or 660 (text)"
    if meta.get("parse") is parse_size:
        return "a whole number of bytes such as 512MiB, 4GiB, 1.5KiB or 1048576"
    if "parse" in meta:
        return str(meta.get("expect", "a valid value"))
    if isinstance(tp, type) and issubclass(tp, enum.StrEnum):
        return f"one of {one_of(tp)}"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(m, {}) for m in typing.get_args(tp) if m is not type(None))
    return {
        int: "an integer",
        float: "a number",
        bool: "true or false",
        str: "a string (without NUL)",
        Path: "a path (not empty, without NUL)",
    }.get(tp, getattr(tp, "__name__", str(tp)))


def _convert(value: Any, tp: Any, text: bool) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        members = [m for m in typing.get_args(tp) if m is not type(None)]
        if value is None and len(members) < len(typing.get_args(tp)):
            return None
        if text and value == "" and len(members) < len(typing.get_args(tp)):
            return None  # an empty variable unsets an optional value
        for member in members:
            try:
                return _convert(value, member, text)
            except (TypeError, ValueError):
                continue
        raise ValueError(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if text and isinstance(value, str):
            if value.strip().lower() in _TRUE:
                return True
            if value.strip().lower() in _FALSE:
                return False
        raise ValueError(value)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if text and isinstance(value, str):
            return int(value.strip(), 10)
        raise ValueError(value)  # 2.5 is not silently 2
    if tp is float:
        number_like = isinstance(value, int | float) and not isinstance(value, bool)
        if not (number_like or (text and isinstance(value, str))):
            raise ValueError(value)
        number = float(value)
        if not math.isfinite(number):  # nan passes every range check written as "x <= 0"
            raise ValueError(value)
        return number
    if isinstance(tp, type) and issubclass(tp, enum.StrEnum):
        if isinstance(value, str):
            return tp(value)  # ValueError unless one of its values, exactly (a member is one)
        raise ValueError(value)
    if tp is str:
        if isinstance(value, str) and "\0" not in value:  # no path, host or name holds a NUL
            return value
        raise ValueError(value)  # a TOML number or boolean where text is expected
    if tp is Path:
        if isinstance(value, str | Path) and "\0" not in str(value) and str(value):  # "" read "."
            return Path(value)
        raise ValueError(value)
    raise TypeError(f"unsupported configuration type {tp!r}")


def coerce(
    value: Any,
    tp: Any,
    *,
    label: str,
    metadata: typing.Mapping[str, Any] | None = None,
    text: bool = False,
) -> Any:
    """``value`` converted to the annotation ``tp`` (or by ``metadata``'s ``parse``/``mode``).

    ``text``: the value came from an environment variable or the command line
    and may be parsed from a string. Raises ``InvalidArgument`` naming ``label``.
    """
    meta = metadata or {}
    parse: Callable[[Any], Any] | None = meta.get("parse")
    try:
        if meta.get("mode"):
            return parse_mode(value)
        if parse is not None:
            return parse(value)
        return _convert(value, tp, text)
    except (TypeError, ValueError, OverflowError) as exc:  # OverflowError: float(10**400)
        # A custom parser's own message says what is wrong (a tenant listed twice, ...).
        reason = f" ({exc})" if "expect" in meta and str(exc) else ""
        raise InvalidArgument(
            f"invalid {label} = {_quoted(value)}: expected {_describe(tp, meta)}{reason}"
        ) from exc


def _quoted(value: Any) -> str:
    """``repr(value)`` as an error quotes it: at most :data:`CLIP_CHARS` characters, the full
    length named when cut (a Python-built config may hold anything, of any size)."""
    try:
        text = repr(value)
    except ValueError:  # an int past sys.get_int_max_str_digits()
        text = f"<an {type(value).__name__} too long to print>"
    return text if len(text) <= CLIP_CHARS else f"{text[:CLIP_CHARS]}... ({len(text)} chars)"


def option(default: Any = dataclasses.MISSING, *, help: str, **meta: Any) -> Any:
    """A dataclass field with its documentation (``help``) and coercion metadata (``parse``, ``mode``)."""
    return dataclasses.field(default=default, metadata={"help": help, **meta})
