"""The ``[limits]`` of one request, checked before any work starts.

Each check raises a precise error that names the limit and its configuration
key: sizes and counts are RESOURCE_EXHAUSTED (:class:`LimitExceeded`), string
lengths and names that are not printable are INVALID_ARGUMENT; a message quotes at
most a short prefix of the client's value (:func:`hicached.errors.clip`). Nothing
here changes state.

Thread-safety: pure functions of their arguments and the frozen config.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from hicached.config import LimitsConfig
from hicached.errors import InvalidArgument, LimitExceeded, clip

__all__ = [
    "ID_FIELDS",
    "check_buffers",
    "check_count",
    "check_id_values",
    "check_identity",
    "check_ids",
    "check_keys",
    "check_pool_names",
    "check_printable",
    "check_response",
]

# Request fields that carry client-chosen identifiers (checked on every RPC that has them).
ID_FIELDS = ("session_id", "op_id", "request_id", "backup_id", "prefetch_id", "pool", "model_name", "tenant")


def check_printable(field: str, value: str) -> None:
    """``value`` (a name the daemon shows: identity strings, pool names) is printable
    (``str.isprintable``: no C0/C1 control, DEL, separator or format character).

    These names reach ``hicached status`` on an admin's terminal, the logs and pool
    segment names in ``/dev/shm``: a worker's ESC sequences in them retitled the admin's
    window, cleared the screen and wrote the clipboard (OSC 52)."""
    if not value.isprintable():
        at = next(i for i, ch in enumerate(value) if not ch.isprintable())
        raise InvalidArgument(
            f"{field} {clip(value)} must be printable: it has {value[at]!r} at position {at}"
        )


def check_count(what: str, n: int, limit: int, key: str) -> None:
    if n > limit:
        raise LimitExceeded(f"{what}: {n} exceeds {key}={limit}", key)


def _check_string(field: str, value: str, limit: int, key: str) -> None:
    # len(str) <= limit is a lower bound of its UTF-8 size: encode only when it could be over.
    if len(value) * 4 > limit and len(value.encode("utf-8", "surrogatepass")) > limit:
        raise InvalidArgument(f"{field} {clip(value)} is longer than {key}={limit} bytes (UTF-8)")


# Message class -> the ID_FIELDS it declares. Every RPC checks its ids; a getattr of a field a
# message lacks raises inside protobuf (~3 us each, ~25 us per call for all eight), so each
# class is asked once. Filled idempotently: a racing fill writes the same value.
_DECLARED: dict[type, tuple[str, ...]] = {}


def _id_fields(request: Any) -> tuple[str, ...]:
    kind = type(request)
    fields = _DECLARED.get(kind)
    if fields is None:
        declared = kind.DESCRIPTOR.fields_by_name
        fields = tuple(name for name in ID_FIELDS if name in declared)
        _DECLARED[kind] = fields
    return fields


def check_ids(request: Any, limits: LimitsConfig) -> None:
    """Every identifier field the request (a protobuf message) has is at most
    ``limits.max_identity_bytes``."""
    check_id_values(((name, getattr(request, name, None)) for name in _id_fields(request)), limits)


def check_id_values(fields: Iterable[tuple[str, object]], limits: LimitsConfig) -> None:
    """As :func:`check_ids` for (field name, value) pairs: the fast lane's, which has no message."""
    for name, value in fields:
        if isinstance(value, str) and value:
            _check_string(name, value, limits.max_identity_bytes, "limits.max_identity_bytes")


def check_pool_names(what: str, names: Iterable[str], limits: LimitsConfig) -> None:
    """The pool named by each of a request's transfers or pages (``what``), within
    ``limits.max_identity_bytes`` and printable (no pool has another name)."""
    limit = limits.max_identity_bytes
    for i, name in enumerate(names):
        # Named only when it could fail: a PutPages of 65,536 pages names a pool per page.
        if len(name) * 4 > limit or not name.isprintable():
            _check_string(f"{what}[{i}].pool", name, limit, "limits.max_identity_bytes")
            check_printable(f"{what}[{i}].pool", name)


def check_identity(identity: Any, limits: LimitsConfig) -> None:
    """The attach identity's strings (instance_id, model_name, tenant): within
    ``limits.max_identity_bytes`` and printable."""
    for name in ("instance_id", "model_name", "tenant"):
        value = getattr(identity, name)
        _check_string(f"identity.{name}", value, limits.max_identity_bytes, "limits.max_identity_bytes")
        check_printable(f"identity.{name}", value)


def check_buffers(pools: Sequence[Any], limits: LimitsConfig) -> None:
    """At most ``limits.max_pools_per_attach`` pools of at most ``limits.max_layers_per_pool``
    layers, ``limits.max_buffers_per_attach`` device buffers (K and V of every pool), and every
    pool name within the identity limit. Byte-only pools have no buffers but cost the daemon a
    host segment, its descriptor and metric series each, and per-layer bookkeeping is built at
    attach: both are counted here, before anything is opened. Pool names must be printable
    too (:func:`check_printable`)."""
    check_count(
        "pools in this attach", len(pools), limits.max_pools_per_attach, "limits.max_pools_per_attach"
    )
    for i, p in enumerate(pools):
        check_count(
            f"layers of pools[{i}]", p.num_layers, limits.max_layers_per_pool, "limits.max_layers_per_pool"
        )
    n = sum(len(p.k_buffers) + len(p.v_buffers) for p in pools)
    check_count(
        "device buffers in this attach", n, limits.max_buffers_per_attach, "limits.max_buffers_per_attach"
    )
    for i, p in enumerate(pools):
        _check_string(f"pools[{i}].name", p.name, limits.max_identity_bytes, "limits.max_identity_bytes")
        check_printable(f"pools[{i}].name", p.name)


def check_keys(keys: Sequence[str], limits: LimitsConfig) -> None:
    """Count and length of the keys of one request (proportional to the request: call it off
    the event loop)."""
    check_count("keys in this request", len(keys), limits.max_keys_per_request, "limits.max_keys_per_request")
    limit = limits.max_key_bytes
    if max(map(len, keys), default=0) * 4 <= limit:
        return  # no key can be over (4 UTF-8 bytes a character at most): no name built per key
    for i, key in enumerate(keys):
        _check_string(f"keys[{i}]", key, limit, "limits.max_key_bytes")


def check_page_readable(page_bytes: int, limits: LimitsConfig, max_message_bytes: int) -> None:
    """A page of ``page_bytes`` (every pool of one key) fits one GetBytes answer: else storing
    it by PutBytes would keep a page that Lookup finds and no GetBytes may read back."""
    check_response(
        "a GetBytes of one page of this session",
        page_bytes,
        limits,
        max_message_bytes,
        fix="it could be stored but never read back; raise that limit, or use smaller pages",
    )


def check_response(
    what: str,
    nbytes: int,
    limits: LimitsConfig,
    max_message_bytes: int,
    *,
    fix: str = "ask for fewer keys per call",
) -> None:
    """A response of ``nbytes`` (computed before building it) fits ``limits.max_response_bytes``
    and the gRPC message limit ``server.max_message_bytes`` (the smaller is named)."""
    bound, key = min((limits.max_response_bytes, "limits.max_response_bytes"),
                     (max_message_bytes, "server.max_message_bytes"))  # fmt: skip
    if nbytes > bound:
        raise LimitExceeded(f"{what} would answer {nbytes} bytes, over {key}={bound}: {fix}", key)
