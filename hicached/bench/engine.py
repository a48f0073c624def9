"""Time to first token: a prompt whose prefix is served from the cache vs a full prefill.

One run, one model, one prompt (transformers, float32, CPU; a Llama built from a
config with seeded random weights, no download), one worker in this process
(``hicached_client.hf.HFKVCache``) against ``hicached serve`` subprocesses:

* ``engine_ttft_prefill_ms``: the whole prompt through the model, first token
  chosen (best of 2).
* ``engine_ttft_l2_hit_ms``: the prompt's page-aligned prefix loaded from the
  daemon's L2 (``GetPages``) into a new ``DynamicCache``, the remaining tokens
  computed, first token chosen (best of 3).
* ``engine_ttft_l3_hit_ms``: the same after a daemon restart (no warm restart),
  so the prefix comes from the file L3 (``GetPages`` with ``include_l3``); one
  measurement (afterwards the pages are in L2 again).
* ``engine_ttft_hit_vs_prefill`` / ``engine_ttft_l3_vs_prefill``: the ratios
  (lower is better; target for the L2 hit at 2,048 tokens: <= 0.1).

Each cached run must choose the prefill's first token with logits within 1e-4
(else RuntimeError). Needs ``transformers``; nothing is printed.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hicached_client import HiCacheClient
from hicached_client.hf import HFKVCache, KVShape

from hicached.bench.daemon import running_daemon

__all__ = ["run"]

PAGE_SIZE = 16
# (hidden, layers, heads, kv heads, intermediate, vocab, prompt tokens)
FULL = (512, 4, 8, 2, 1408, 4096, 2048)
QUICK = (256, 2, 4, 2, 704, 2048, 1024)


def _model(hidden: int, layers: int, heads: int, kv_heads: int, inter: int, vocab: int) -> Any:
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("the engine suite needs transformers (pip install transformers)") from exc
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()  # type: ignore[no-untyped-call]


def _new_cache() -> Any:
    from transformers import DynamicCache

    return DynamicCache()


@torch.no_grad()
def _first_token(model: Any, tokens: list[int], cache: Any) -> torch.Tensor:
    logits: torch.Tensor = model(torch.tensor([tokens]), past_key_values=cache, use_cache=True).logits[0, -1]
    return logits


def _timed(fn: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    logits = fn()
    int(logits.argmax())  # the first token is chosen
    return time.perf_counter() - start, logits


def _check(name: str, logits: torch.Tensor, want: torch.Tensor) -> None:
    if int(logits.argmax()) != int(want.argmax()) or not torch.allclose(logits, want, atol=1e-4, rtol=1e-4):
        raise RuntimeError(f"{name}: first-token logits differ from the full prefill")


def run(quick: bool) -> dict[str, float]:
    """TTFT from the cache (L2, L3 after a restart) vs a full prefill of the same prompt (ms, ratios)."""
    hidden, layers, heads, kv_heads, inter, vocab, prompt_tokens = QUICK if quick else FULL
    model = _model(hidden, layers, heads, kv_heads, inter, vocab)
    shape = KVShape.of(model.config, torch.float32)
    prompt = torch.randint(0, vocab, (prompt_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    name = f"bench/llama-{uuid.uuid4().hex[:8]}"
    slots = -(-prompt_tokens // PAGE_SIZE) * PAGE_SIZE
    kv_bytes = 2 * shape.num_layers * slots * shape.kv_heads * shape.head_dim * 4

    def worker(client: HiCacheClient) -> HFKVCache:
        return HFKVCache(
            client, model_name=name, shape=shape, page_size=PAGE_SIZE, slots=slots, host_bytes=4 * kv_bytes
        )

    workdir = Path(tempfile.mkdtemp(prefix="hicached-bench-engine-"))
    l3 = workdir / "l3"
    try:
        runs = [_timed(lambda: _first_token(model, prompt, _new_cache())) for _ in range(2)]
        prefill_s, want = min(r[0] for r in runs), runs[0][1]
        cache = _new_cache()
        _first_token(model, prompt, cache)

        def from_cache(kv: HFKVCache, include_l3: bool) -> torch.Tensor:
            restored, hit = kv.load_prefix(prompt, include_l3=include_l3)
            if restored is None:
                raise RuntimeError("the prompt's prefix missed the cache")
            return _first_token(model, prompt[hit:], restored)

        (workdir / "a").mkdir()
        with (
            running_daemon(workdir / "a", host_budget="512MiB", l3="file", l3_path=l3) as target,
            HiCacheClient(target) as client,
            worker(client) as kv,
        ):
            kv.save_prefix(prompt, cache)
            kv.persist(prompt)  # durable in L3 before the restart
            cached = kv.cached_tokens(prompt[:-1], include_l3=False)
            l2_runs = [_timed(lambda: from_cache(kv, False)) for _ in range(3)]
        (workdir / "b").mkdir()
        with (
            running_daemon(workdir / "b", host_budget="512MiB", l3="file", l3_path=l3) as target,
            HiCacheClient(target) as client,
            worker(client) as kv2,
        ):
            if kv2.cached_tokens(prompt[:-1], include_l3=False) != 0:
                raise RuntimeError("the restarted daemon should start with an empty L2")
            l3_s, l3_logits = _timed(lambda: from_cache(kv2, True))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for _, logits in l2_runs:
        _check("L2 hit", logits, want)
    _check("L3 hit", l3_logits, want)
    l2_s = min(r[0] for r in l2_runs)
    params = sum(p.numel() for p in model.parameters())
    return {
        "engine_model_params_m": params / 1e6,
        "engine_model_layers": float(layers),
        "engine_model_hidden": float(hidden),
        "engine_prompt_tokens": float(prompt_tokens),
        "engine_cached_tokens": float(cached),
        "engine_kv_mib": kv_bytes / 2**20,
        "engine_ttft_prefill_ms": prefill_s * 1e3,
        "engine_ttft_l2_hit_ms": l2_s * 1e3,
        "engine_ttft_l3_hit_ms": l3_s * 1e3,
        "engine_ttft_hit_vs_prefill": l2_s / prefill_s,
        "engine_ttft_l3_vs_prefill": l3_s / prefill_s,
    }
