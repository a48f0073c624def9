"""Each error class carries its gRPC code; the most derived class decides (issue 14 item 3)."""

from __future__ import annotations

import errno

import grpc
import pytest

from hicached import errors
from hicached.config import ConfigError
from hicached.server.status import MAX_MESSAGE_CHARS, answer_for, status_for


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


ERROR_CLASSES = sorted({c for c in _subclasses(errors.HiCacheError) if c.__module__.startswith("hicached")},
                       key=lambda c: c.__qualname__)  # fmt: skip


def test_the_scan_sees_the_error_classes() -> None:
    assert {errors.OutOfRange, errors.LimitExceeded, ConfigError} <= set(ERROR_CLASSES)


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__qualname__)
def test_every_error_class_answers_a_client_code(cls: type[errors.HiCacheError]) -> None:
    """No daemon error class may fall through to INTERNAL (that is for bugs) or UNKNOWN."""
    assert cls.code is not None, f"{cls.__qualname__} names no code"
    code = grpc.StatusCode[cls.code]
    assert code not in (grpc.StatusCode.OK, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL)
    exc = cls.__new__(cls)
    assert status_for(exc) is code


def test_a_subclass_with_its_own_code_wins_over_its_base() -> None:
    """Failed on the ordered table it replaces: a subclass declared after its base's entry
    (here, after the whole table) got the base's code."""

    class Lost(errors.InvalidArgument):
        code = "DATA_LOSS"

    assert status_for(Lost("x")) is grpc.StatusCode.DATA_LOSS
    assert status_for(errors.OutOfRange("x")) is grpc.StatusCode.OUT_OF_RANGE
    assert status_for(errors.InvalidArgument("x")) is grpc.StatusCode.INVALID_ARGUMENT


def test_a_subclass_without_a_code_inherits_its_base_code() -> None:
    assert status_for(errors.DoubleFree("x")) is grpc.StatusCode.FAILED_PRECONDITION
    assert status_for(errors.LimitExceeded("x", "limits.k")) is grpc.StatusCode.RESOURCE_EXHAUSTED


def test_the_base_class_and_foreign_errors_are_bugs() -> None:
    assert status_for(errors.HiCacheError("x")) is None
    assert status_for(ValueError("x")) is None
    assert status_for(OSError(errno.ENOENT, "x")) is None
    assert status_for(OSError(errno.EMFILE, "x")) is grpc.StatusCode.RESOURCE_EXHAUSTED


def test_one_answer_per_error_for_every_transport() -> None:
    """``answer_for`` is what gRPC's interceptor and the fast lane both send."""
    exhausted = answer_for(OSError(errno.EMFILE, "Too many open files"), "Write")
    assert (exhausted.code, exhausted.log_it) == (grpc.StatusCode.RESOURCE_EXHAUSTED, False)
    assert exhausted.message.startswith(
        "the daemon is out of resources in Write: EMFILE (Too many open files)"
    )
    bug = answer_for(ValueError("x" * 5000), "GetPages")
    assert (bug.code, bug.log_it, bug.retry_after_ms) == (grpc.StatusCode.INTERNAL, True, None)
    assert bug.message.startswith("internal error in GetPages: ValueError: xxx")
    whole = len("internal error in GetPages: ValueError: ") + 5000
    assert (
        bug.message
        == f"internal error in GetPages: ValueError: {'x' * 5000}"[:MAX_MESSAGE_CHARS]
        + f"... ({whole} chars)"
    )
    busy = answer_for(errors.ResourceExhausted("busy", retry_after_ms=40), "Load")
    assert busy == (grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", 40, False)
