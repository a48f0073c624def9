"""Serve a transformers model's prompt prefix from a hicached daemon (CPU, no download).

    pip install './clients/python[hf]'                 # transformers and torch
    hicached serve --socket "$HICACHED_SOCKET" &       # a daemon (its directory: not /tmp itself)
    python examples/hf_prefix_cache.py                 # twice: the second run is served from it

The first run prefills the prompt and stores its KV pages in the daemon; run it
again (another process) and the prefix is restored from the daemon instead of
recomputed: the first token comes faster and the 32 generated tokens are the same.
The model is a small Llama with seeded random weights, so no download is needed;
with a real checkpoint use ``AutoModelForCausalLM.from_pretrained`` and the same
``HFKVCache`` calls. The KV area follows the model's dtype (``KVShape.of(config,
model.dtype)``; a bf16 model keeps bf16 pages), and ``token_ids`` may be the
tokenizer's ``input_ids`` as they are (shape ``(1, seq)``).
"""

from __future__ import annotations

import sys
import time

import torch
from hicached_client import HiCacheClient
from hicached_client.hf import HFKVCache, KVShape
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM


@torch.no_grad()
def next_logits(model: LlamaForCausalLM, tokens: list[int], cache: DynamicCache) -> torch.Tensor:
    return model(torch.tensor([tokens]), past_key_values=cache, use_cache=True).logits[0, -1]


def main(target: str | None) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    prompt = torch.randint(0, 4096, (2048,), generator=torch.Generator().manual_seed(1)).tolist()
    with (
        HiCacheClient(target) as client,
        HFKVCache(
            client, model_name="example/llama-512", shape=KVShape.of(config, model.dtype), slots=2048
        ) as kv,
    ):
        start = time.perf_counter()
        cache, hit = kv.load_prefix(prompt)  # (None, 0) on a miss
        cache = cache if cache is not None else DynamicCache()
        logits = next_logits(model, prompt[hit:], cache)
        ttft = time.perf_counter() - start
        tokens = [int(logits.argmax())]
        if hit == 0:
            kv.save_prefix(prompt, cache)  # publish for the next process
            print("verified: a miss; the prompt was prefilled and its prefix saved")
        else:  # the restored prefix must predict exactly what a full recompute predicts
            full = next_logits(model, prompt, DynamicCache())
            assert torch.allclose(full, logits, atol=1e-4), "restored prefix differs from a recompute"
            print("verified: the restored prefix gives the recompute's next-token logits")
        for _ in range(31):
            tokens.append(int(next_logits(model, tokens[-1:], cache).argmax()))
    print(f"{hit} of {len(prompt)} prompt tokens from the cache; first token after {ttft * 1e3:.0f} ms")
    print("generated:", tokens)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)  # default: $HICACHED_SOCKET, else the daemon's default
