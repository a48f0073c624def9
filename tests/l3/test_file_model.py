"""The file backend against a dict model: random sets, deletes, clears, reads and restarts."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hicached.l3 import create_backend
from hicached.l3.base import StorageBackend

KEYS = st.sampled_from([f"{tenant}/{i}" for tenant in ("a", "b") for i in range(12)])
VALUES = st.binary(min_size=0, max_size=3000)


class FileBackendModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="hicached-l3-model-"))
        self.backend: StorageBackend | None = self._open()
        self.model: dict[str, bytes] = {}

    def _open(self) -> StorageBackend:
        return create_backend("file", {"path": str(self.root), "capacity_bytes": 1 << 30, "io_threads": 2})

    @property
    def store(self) -> StorageBackend:
        assert self.backend is not None
        return self.backend

    @rule(items=st.lists(st.tuples(KEYS, VALUES), max_size=6))
    def set_batch(self, items: list[tuple[str, bytes]]) -> None:
        keys = [k for k, _ in items]
        assert self.store.set(keys, [v for _, v in items]) == [True] * len(items)
        for key, value in items:
            self.model.setdefault(key, value)  # a present key is not rewritten

    @rule(keys=st.lists(KEYS, max_size=6))
    def get_batch(self, keys: list[str]) -> None:
        assert self.store.get(keys) == [self.model.get(k) for k in keys]
        dests = [bytearray(len(self.model.get(k, b""))) for k in keys]
        ok = self.store.get_into(keys, [[memoryview(d)] for d in dests])
        assert ok == [k in self.model for k in keys]
        assert [bytes(d) for d, good in zip(dests, ok, strict=True) if good] == [
            self.model[k] for k in keys if k in self.model
        ]

    @rule(keys=st.lists(KEYS, max_size=4))
    def delete(self, keys: list[str]) -> None:
        assert self.store.delete(keys) == len({k for k in keys if k in self.model})
        for key in keys:
            self.model.pop(key, None)

    @rule(prefix=st.sampled_from(["a/", "b/", "a/1", ""]))
    def clear(self, prefix: str) -> None:
        gone = [k for k in self.model if k.startswith(prefix)]
        assert self.store.clear(prefix) == len(gone)
        for key in gone:
            del self.model[key]

    @rule()
    def restart(self) -> None:
        self.store.close()
        self.backend = self._open()

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def exists_run(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(KEYS, max_size=5))
        expected = 0
        for key in keys:
            if key not in self.model:
                break
            expected += 1
        assert self.store.exists(keys) == expected

    @invariant()
    def counts_match(self) -> None:
        stats = self.store.stats()
        assert stats.pages == len(self.model)
        assert stats.bytes == sum(len(v) for v in self.model.values())
        assert stats.corrupt_pages == 0

    def teardown(self) -> None:
        if self.backend is not None:
            self.backend.close()
        shutil.rmtree(self.root, ignore_errors=True)


FileBackendModel.TestCase.settings = settings(max_examples=25, stateful_step_count=25, deadline=None)
TestFileBackendModel = FileBackendModel.TestCase
