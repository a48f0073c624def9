"""PageOwners and PageLedger: one owner table per group, a ledger per session on it."""

from __future__ import annotations

import numpy as np
import pytest

from hicached.core import ledger
from hicached.core.ledger import PageOwners
from hicached.errors import FailedPrecondition, InvalidArgument


def pages(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def test_each_ledger_owns_what_it_was_given_and_takes_only_that() -> None:
    owners = PageOwners({"kv": 16, "swa": 16})
    a, b = owners.ledger(), owners.ledger()
    a.add("kv", pages(1, 2, 3))
    b.add("kv", pages(4, 5))
    b.add("swa", pages(1))
    assert a.owns("kv", pages(1, 4, 3)).tolist() == [True, False, True]
    assert (a.count(), b.count()) == (3, 3)
    assert a.take([("kv", pages(3, 4))]) == ("kv", 4)  # not all a's: nothing taken
    assert a.count() == 3
    assert a.take([("kv", pages(3))]) is None
    assert a.owns("kv", pages(3)).tolist() == [False]
    a.give([("kv", pages(3))])
    assert {k: v.tolist() for k, v in a.take_all().items()} == {"kv": [1, 2, 3], "swa": []}
    assert b.count() == 3 and b.owns("swa", pages(1)).tolist() == [True]


def test_take_all_returns_every_page_and_closes_the_ledger(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ledger, "_SCAN_PAGES", 4)  # scanned in chunks, as a large pool is
    owners = PageOwners({"kv": 40})
    a = owners.ledger()
    a.add("kv", pages(39, 0, 7))
    taken = a.take_all()
    assert {k: v.tolist() for k, v in taken.items()} == {"kv": [0, 7, 39]}
    assert a.take_all() == {}  # idempotent
    with pytest.raises(FailedPrecondition):
        a.add("kv", pages(1))
    c = owners.ledger()  # a's holder number, reused: it owns nothing of a's
    assert c.count() == 0 and not c.owns("kv", pages(0, 7, 39)).any()
    c.add("kv", pages(5, 38))
    assert c.count() == 2


def test_a_pool_that_does_not_allocate_is_owned_by_nobody() -> None:
    owners = PageOwners({"kv": 8})
    a = owners.ledger()
    assert a.owns("draft", pages(1, 2)).tolist() == [False, False]
    assert a.take([("draft", pages(2))]) == ("draft", 2)
    with pytest.raises(InvalidArgument):
        a.add("draft", pages(1))
