"""``HFKVCache`` refuses what it cannot store faithfully, and cleans up (review28 findings
1, 3, 4, 5, 8, 10, 11). A real daemon, the adapter in this process, real ``DynamicCache``s.

The session's geometry is 2 layers, 2 kv heads, head_dim 8, float32, 16-token pages and a
64-token area; caches of another geometry must be refused before anything is copied or sent,
since the stored pages are what every worker of the model restores for the same tokens.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hicached_client import HiCacheClient, HiCacheError
from hicached_client.hf import HFKVCache, KVShape
from transformers import DynamicCache, MistralConfig

from tests.engines.conftest import unique_model
from tests.engines.model import forward, prompt, tiny_llama
from tests.support.daemon import Daemon

SHAPE = KVShape(num_layers=2, kv_heads=2, head_dim=8, dtype=torch.float32)
PAGE, SLOTS = 16, 64


@pytest.fixture
def client(daemon: Daemon) -> Iterator[HiCacheClient]:
    with HiCacheClient(daemon.target) as c:
        yield c


def open_kv(client: HiCacheClient, model: str | None = None, **kwargs: Any) -> HFKVCache:
    return HFKVCache(
        client, model_name=model or unique_model(), shape=SHAPE, page_size=PAGE, slots=SLOTS, **kwargs
    )


def kv_cache(
    *,
    layers: int = 2,
    batch: int = 1,
    heads: int = 2,
    seq: int = 40,
    dim: int = 8,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    config: Any = None,
) -> DynamicCache:
    cache = DynamicCache(config=config) if config is not None else DynamicCache()
    gen = torch.Generator().manual_seed(seed)
    for i in range(layers):
        k = torch.randn(batch, heads, seq, dim, generator=gen).to(dtype)
        v = torch.randn(batch, heads, seq, dim, generator=gen).to(dtype)
        cache.update(k, v, i)
    return cache


SLIDING = MistralConfig(
    sliding_window=2,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    hidden_size=16,
    head_dim=8,
)
MISMATCHES: dict[str, tuple[Callable[[], DynamicCache], str]] = {
    "fewer layers": (lambda: kv_cache(layers=1), "cache has 1 layers, the session 2"),
    "more layers": (lambda: kv_cache(layers=3), "cache has 3 layers, the session 2"),
    "batch 2": (lambda: kv_cache(batch=2), "batch 2: HFKVCache takes batch-1 caches"),
    "one kv head": (lambda: kv_cache(heads=1), "1 kv heads of head_dim 8, the session 2 of 8"),
    "head_dim 4": (lambda: kv_cache(dim=4), "2 kv heads of head_dim 4, the session 2 of 8"),
    "float64": (lambda: kv_cache(dtype=torch.float64), "dtype torch.float64 != session torch.float32"),
    "sliding window": (lambda: kv_cache(config=SLIDING), "sliding-window layer"),
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_a_cache_of_another_geometry_is_refused_before_anything_is_staged(
    client: HiCacheClient, case: str
) -> None:
    """Finding 1: such caches were stored (broadcast, truncated, converted, or with the
    previous request's stale layer), under keys every worker of the model trusts."""
    make, message = MISMATCHES[case]
    tokens = prompt(seed=7, tokens=40)
    with open_kv(client) as kv:
        kv.save_prefix(prompt(seed=8, tokens=40), kv_cache(seed=8))  # another request's KV in the area
        area = [t.clone() for t in kv.pool.k + kv.pool.v]
        cache = make()
        with pytest.raises(ValueError, match=message):
            kv.save_prefix(tokens, cache)
        with pytest.raises(ValueError, match=message):
            kv.retract("req-bad", cache)
        assert all(torch.equal(a, t) for a, t in zip(area, kv.pool.k + kv.pool.v, strict=True))
        assert kv.cached_tokens(tokens) == 0
        assert kv.session.stats().backups == ()


def test_the_shape_follows_the_models_dtype(client: HiCacheClient) -> None:
    """Finding 3: ``KVShape.of`` defaulted to float32: a bf16 model's KV came back unusable."""
    model = tiny_llama().to(torch.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        KVShape.of(model.config)  # a config built in code names no dtype: say it, do not guess
    assert KVShape.of(model.config, model.dtype).dtype == torch.bfloat16
    model.config.dtype = "bfloat16"  # as from_pretrained leaves it
    shape = KVShape.of(model.config)
    assert shape.dtype == torch.bfloat16
    tokens = prompt(tokens=40)
    cache = DynamicCache()
    full = forward(model, tokens, cache)
    with HFKVCache(client, model_name=unique_model(), shape=shape, page_size=PAGE, slots=SLOTS) as kv:
        assert kv.save_prefix(tokens, cache) == 2
        restored, hit = kv.load_prefix(tokens)
        assert hit == 32
        assert restored.layers[0].keys.dtype == torch.bfloat16
        assert torch.equal(restored.layers[1].values, cache.layers[1].values[:, :, :32])
        # The model runs on the restored bf16 cache and predicts what the full prefill did.
        assert torch.allclose(forward(model, tokens[hit:], restored).float(), full.float(), atol=0.05)
        with pytest.raises(ValueError, match=r"dtype torch\.float32 != session torch\.bfloat16"):
            kv.save_prefix(tokens, kv_cache(dim=shape.head_dim))  # the float32 twin of the cache


def test_token_ids_as_a_tokenizer_returns_them(client: HiCacheClient) -> None:
    """Finding 4: ``input_ids`` of shape (1, seq) were a silent permanent miss."""
    ids = prompt(tokens=49)
    input_ids = torch.tensor([ids])  # what a tokenizer returns, batch of one
    cache = kv_cache(seq=49)
    with open_kv(client) as kv:
        assert kv.save_prefix(input_ids, cache) == 3
        for given in (input_ids, input_ids[0], input_ids.numpy(), [ids], ids):
            assert kv.cached_tokens(given) == 48
            assert kv.load_prefix(given)[1] == 48
        for bad, message in (
            (torch.tensor([ids, ids]), r"1-D ids of one sequence, got shape \(2, 49\)"),
            (torch.tensor([[ids]]), r"got shape \(1, 1, 49\)"),
            (torch.rand(49), "must be integers"),
            ("some text", "must be integer ids"),
        ):
            for call in (kv.cached_tokens, kv.load_prefix, lambda t: kv.save_prefix(t, cache)):
                with pytest.raises(ValueError, match=message):
                    call(bad)


def test_workers_of_different_tenants_do_not_share_pages(client: HiCacheClient) -> None:
    """Finding 8: there was no tenant; every HF worker of a model shared one namespace."""
    model, tokens = unique_model(), prompt(tokens=49)
    with open_kv(client, model, tenant="team-a") as a:
        assert a.save_prefix(tokens, kv_cache(seq=49)) == 3
    with open_kv(client, model, tenant="team-b") as b:
        assert b.cached_tokens(tokens) == 0
        assert b.load_prefix(tokens) == (None, 0)
    with open_kv(client, model, tenant="team-a") as a:
        assert a.cached_tokens(tokens) == 48


def test_a_prompt_longer_than_the_area_is_saved_and_loaded_up_to_its_size(client: HiCacheClient) -> None:
    """Finding 10: ``save_prefix`` raised on it while ``load_prefix`` silently capped it."""
    tokens, cache = prompt(tokens=100), kv_cache(seq=100)
    with open_kv(client) as kv:
        assert kv.save_prefix(tokens, cache) == SLOTS // PAGE
        assert kv.cached_tokens(tokens) == SLOTS
        restored, hit = kv.load_prefix(tokens)
        assert hit == SLOTS
        assert torch.equal(restored.layers[1].keys, cache.layers[1].keys[:, :, :SLOTS])


def memfd_in_use(name: str) -> bool:
    """Whether this process still holds an fd or a mapping of the memfd labelled ``name``."""
    fds = Path("/proc/self/fd")
    links = []
    for fd in os.listdir(fds):
        try:
            links.append(os.readlink(fds / fd))
        except OSError:
            continue  # the listing's own fd, closed by now
    return (
        any(f"memfd:{name}" in link for link in links)
        or f"memfd:{name}" in Path("/proc/self/maps").read_text()
    )


def test_close_frees_the_area_when_the_detach_fails_and_later_use_is_refused(daemon: Daemon) -> None:
    """Findings 5 and 11: a failed Detach leaked the memfd and its mapping; use after close
    raised IndexError (or still sent an RPC)."""
    client = HiCacheClient(daemon.target)
    kv = open_kv(client)
    name = kv.pool.name
    assert memfd_in_use(name)
    client.close()  # the Detach can no longer be sent
    with pytest.raises(HiCacheError):
        kv.close()
    assert not memfd_in_use(name)
    tokens, cache = prompt(tokens=40), kv_cache()
    for call in (
        lambda: kv.save_prefix(tokens, cache),
        lambda: kv.load_prefix(tokens),
        lambda: kv.cached_tokens(tokens),
        lambda: kv.persist(tokens),
        lambda: kv.retract("req", cache),
    ):
        with pytest.raises(ValueError, match="HFKVCache is closed"):
            call()
