"""The engine tests' model: a small Llama built from a config with seeded random weights.

No download: every process that calls :func:`tiny_llama` with the same seed
gets the same weights (float32, CPU, eager attention), so two worker processes
compute the same KV for the same tokens.
"""

from __future__ import annotations

from typing import Any

import torch
from hicached_client.hf import KVShape
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS = 256, 64, 2, 4, 2
PAGE_SIZE = 16
PROMPT_TOKENS = 100  # 6 whole pages (96 tokens) restorable, 4 tokens computed
GENERATE = 32


def tiny_llama(seed: int = 0) -> Any:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=4096,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def shape(model: Any) -> KVShape:
    return KVShape.of(model.config, torch.float32)


def prompt(seed: int = 1, tokens: int = PROMPT_TOKENS) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (tokens,), generator=gen).tolist()


@torch.no_grad()
def forward(model: Any, token_ids: list[int], cache: Any) -> torch.Tensor:
    """Logits of the last of ``token_ids`` (appended to ``cache``, which grows)."""
    out = model(torch.tensor([token_ids]), past_key_values=cache, use_cache=True)
    return out.logits[0, -1]


def greedy(model: Any, cache: Any, logits: torch.Tensor, count: int) -> list[int]:
    """``count`` greedy tokens, the first from ``logits``; ``cache`` grows by ``count - 1``."""
    tokens = [int(logits.argmax())]
    while len(tokens) < count:
        tokens.append(int(forward(model, [tokens[-1]], cache).argmax()))
    return tokens


def full_run(model: Any, token_ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Reference: next-token logits of a full prefill, and the greedy continuation."""
    cache = DynamicCache()
    logits = forward(model, token_ids, cache)
    return logits, greedy(model, cache, logits, GENERATE)
