"""A transformers worker process for the engine tests; prints one JSON report line.

    python -m tests.engines.hf_worker SCENARIO --target T --model M [--prompt-seed N]

Scenarios:

* ``publish``: prefill the prompt, store its page-aligned prefix in the daemon.
* ``continue``: restore the longest cached prefix of the prompt into a new
  cache, compute the rest of the prompt, report the next-token logits and 32
  greedy tokens.
* ``retract``: prefill, generate 10 tokens, back the request's KV up to the
  daemon, clobber it (the cache is dropped, the shared area overwritten),
  restore it into other slots and generate the remaining 22 tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from hicached_client import HiCacheClient
from hicached_client.hf import HFKVCache
from transformers import DynamicCache

from tests.engines.model import GENERATE, PAGE_SIZE, forward, greedy, prompt, shape, tiny_llama

SLOTS = 1024


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["publish", "continue", "retract"])
    parser.add_argument("--target", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt-seed", type=int, default=1)
    args = parser.parse_args()
    model = tiny_llama()
    tokens = prompt(args.prompt_seed)
    report: dict[str, object] = {}
    with (
        HiCacheClient(args.target) as client,
        HFKVCache(
            client,
            model_name=args.model,
            shape=shape(model),
            page_size=PAGE_SIZE,
            slots=SLOTS,
            generation=time.time_ns(),
        ) as kv,
    ):
        if args.scenario == "publish":
            cache = DynamicCache()
            forward(model, tokens, cache)
            report["saved_pages"] = kv.save_prefix(tokens, cache)
        elif args.scenario == "continue":
            report["cached_tokens"] = kv.cached_tokens(tokens)
            cache, hit = kv.load_prefix(tokens)
            if cache is None:
                cache = DynamicCache()
            logits = forward(model, tokens[hit:], cache)
            report["hit_tokens"] = hit
            report["logits"] = logits.tolist()
            report["tokens"] = greedy(model, cache, logits, GENERATE)
        else:
            cache = DynamicCache()
            logits = forward(model, tokens, cache)
            first = greedy(model, cache, logits, 10)
            # The cache holds the prompt and 9 generated tokens; the 10th is the next input.
            retracted = kv.retract("req-1", cache, first_page=0)
            assert retracted is not None, "the daemon declined the backup"
            report["retracted_tokens"] = retracted.num_tokens
            del cache
            for t in kv.pool.k + kv.pool.v:
                t.copy_(torch.randn(t.shape))
            other = -(-retracted.num_tokens // PAGE_SIZE) + 3  # restore into different slots
            restored = kv.resume(retracted, first_page=other)
            report["restored_tokens"] = restored.get_seq_length()
            logits = forward(model, [first[-1]], restored)
            report["tokens"] = first + greedy(model, restored, logits, GENERATE - 10)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
