"""A separate SGLang "rank" process: ``python -m tests.sglang.worker '<json>'``.

It builds a real host pool and a storage through SGLang's factory, then writes
(seeded random pages) or reads pages by key, and prints one JSON line: the
per-call results and the sha256 of the pages' bytes.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from tests.sglang.pools import PoolShape, StorageFactory, digest, make_host_pool, page_bits, randomize


def run(args: dict[str, Any]) -> dict[str, Any]:
    shape = PoolShape(**args["shape"])
    pool = make_host_pool(shape)
    factory = StorageFactory(args["target"])
    try:
        storage = factory.make(pool, **args["storage"])
        keys: list[str] = args["keys"]
        idx = pool.alloc(len(keys) * shape.page_size)
        if args["op"] == "write":
            randomize(pool, seed=args["seed"])
            results = storage.batch_set_v1(keys, idx)
        else:
            results = storage.batch_get_v1(keys, idx)
        return {"results": results, "digest": digest(page_bits(pool, idx))}
    finally:
        factory.close_all()


if __name__ == "__main__":
    print(json.dumps(run(json.loads(sys.argv[1]))), flush=True)
