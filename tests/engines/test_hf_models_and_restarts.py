"""``HFKVCache`` as a review of stop 45 used it: pages of a model whose config differs never
restored, a daemon restart survived, and bad input refused with what to do. A real daemon,
the adapter in this process, real ``DynamicCache``s (no model compute but where it matters)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch
from hicached_client import HiCacheClient, HiCacheError
from hicached_client.hf import HFKVCache, KVShape
from transformers import LlamaConfig

from hicached.testing.daemon import launch, scratch_dir
from tests.engines.conftest import unique_model
from tests.engines.model import prompt
from tests.engines.test_hf_guards import PAGE, SLOTS, kv_cache
from tests.support.daemon import Daemon


@pytest.fixture
def client(daemon: Daemon) -> Iterator[HiCacheClient]:
    with HiCacheClient(daemon.target) as c:
        yield c


def llama(**changes: Any) -> LlamaConfig:
    """A config of the guards' geometry (2 layers, 2 kv heads, head_dim 8); ``changes`` alter
    what is not geometry."""
    base: dict[str, Any] = {
        "vocab_size": 256,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
    }
    return LlamaConfig(**{**base, **changes})


def test_models_whose_configs_differ_never_restore_each_others_pages(client: HiCacheClient) -> None:
    """Fails before: a model of the same name and KV geometry but another config (other query
    heads, rope_theta) hit the first model's pages and computed wrong logits from them."""
    model, tokens, cache = unique_model(), prompt(tokens=40), kv_cache()
    shape = KVShape.of(llama(), torch.float32)
    with HFKVCache(client, model_name=model, shape=shape, page_size=PAGE, slots=SLOTS) as kv:
        assert kv.save_prefix(tokens, cache) == 2
    for other in (llama(num_attention_heads=8, hidden_size=64), llama(rope_theta=500000.0)):
        changed = KVShape.of(other, torch.float32)
        assert changed.num_layers == shape.num_layers and changed.kv_heads == shape.kv_heads
        assert changed.head_dim == shape.head_dim  # the same geometry: only the digest differs
        with HFKVCache(client, model_name=model, shape=changed, page_size=PAGE, slots=SLOTS) as kv:
            assert kv.cached_tokens(tokens) == 0
            assert kv.load_prefix(tokens) == (None, 0)
    # The same config built again (another process would) and loaded otherwise still hits.
    again = llama(
        use_cache=False, name_or_path="/somewhere/else", architectures=["LlamaForCausalLM"], pad_token_id=0
    )
    assert again._name_or_path == "/somewhere/else" and again.pad_token_id == 0
    same = KVShape.of(again, torch.float32)
    with HFKVCache(client, model_name=model, shape=same, page_size=PAGE, slots=SLOTS) as kv:
        restored, hit = kv.load_prefix(tokens)
        assert hit == 32 and torch.equal(restored.layers[1].keys, cache.layers[1].keys[:, :, :32])


def test_a_daemon_restart_is_survived_by_attaching_again() -> None:
    """Fails before: after the daemon restarted, every call of the ``HFKVCache`` raised NOT_FOUND
    (unknown session) for good. Now the call attaches again (same identity and area) and is
    re-sent: the prefix persisted to L3 before the restart hits after it, on the same object."""
    workdir = scratch_dir("hchf")
    args = ("--l3", "file", "--set", f"l3.file.path={workdir / 'l3'}", "--host-budget", "64MiB")
    socket = workdir / "d.sock"
    first = launch(*args, workdir=workdir, socket=socket, owns_workdir=False)
    tokens, cache = prompt(tokens=40), kv_cache()
    try:
        with HiCacheClient(first.target) as client:
            shape = KVShape.of(llama(), torch.float32)
            with HFKVCache(client, model_name=unique_model(), shape=shape, page_size=PAGE, slots=SLOTS) as kv:
                assert kv.save_prefix(tokens, cache) == 2
                kv.persist(tokens)  # in L3 once it returns (the policy may have written it already)
                retracted = kv.retract("req", kv_cache(seq=20))
                assert retracted is not None
                lost = kv.session
                assert first.stop() == 0
                second = launch(*args, workdir=workdir, socket=socket, owns_workdir=False)
                # A heartbeat that met the socket gone left the channel in its reconnect backoff,
                # where a call fails UNAVAILABLE at once: wait until it has reconnected (what is
                # tested here is the answer of the new daemon, not the channel's backoff).
                client.wait_ready(30.0)
                try:
                    with pytest.raises(HiCacheError) as err:  # host memory of the lost session
                        kv.resume(retracted)
                    assert (
                        err.value.code == grpc.StatusCode.NOT_FOUND and "retract again" in err.value.message
                    )
                    restored, hit = kv.load_prefix(tokens)
                    assert kv.session is not lost, "attached again"
                    assert hit == 32 and torch.equal(
                        restored.layers[0].values, cache.layers[0].values[:, :, :32]
                    )
                    assert kv.save_prefix(prompt(seed=3, tokens=40), kv_cache(seed=3)) == 2
                finally:
                    kv.close()
                    second.stop()
    finally:
        first.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def test_an_unknown_retraction_is_the_calls_answer_not_a_lost_session(client: HiCacheClient) -> None:
    """NOT_FOUND is also a call's own answer: resuming a retraction twice raises it, on the same
    session (a heartbeat says the daemon still knows it; nothing attaches again)."""
    shape = KVShape.of(llama(), torch.float32)
    with HFKVCache(client, model_name=unique_model(), shape=shape, page_size=PAGE, slots=SLOTS) as kv:
        retracted = kv.retract("req-1", kv_cache(seq=20))
        assert retracted is not None
        kv.resume(retracted, first_page=2)
        session = kv.session
        with pytest.raises(HiCacheError) as err:
            kv.resume(retracted)
        assert err.value.code == grpc.StatusCode.NOT_FOUND and "retraction" in err.value.message
        assert kv.session is session


def test_bad_input_is_a_value_error_that_says_what_to_do(client: HiCacheClient) -> None:
    """Fails before: a legacy tuple cache raised AttributeError, an unknown dtype name was
    quoted as None, page_size 0 divided by zero, a negative token id raised protobuf's
    "Value out of range" and one of 2**64 was "not an integer"; a cache too large for the
    area did not say that ``slots=`` sets its size."""
    shape = KVShape.of(llama(), torch.float32)
    with pytest.raises(ValueError, match=r"'bf16' \(e\.g\. torch\.bfloat16"):
        KVShape.of(llama(), "bf16")
    with pytest.raises(ValueError, match="positive multiple of page_size=0"):
        HFKVCache(client, model_name=unique_model(), shape=shape, page_size=0, slots=SLOTS)
    legacy = tuple((layer.keys, layer.values) for layer in kv_cache().layers)
    with HFKVCache(client, model_name=unique_model(), shape=shape, page_size=PAGE, slots=SLOTS) as kv:
        for call in (lambda: kv.save_prefix(prompt(tokens=40), legacy), lambda: kv.retract("r", legacy)):
            with pytest.raises(ValueError, match="expected a transformers DynamicCache, got tuple"):
                call()
        for ids, shown in (([1, -1, *range(38)], "-1"), ([1, 2**64, *range(38)], str(2**64))):
            for use in (kv.cached_tokens, kv.load_prefix, lambda t: kv.save_prefix(t, kv_cache())):
                with pytest.raises(ValueError, match=rf"token_ids must lie in \[0, 2\*\*64\), got {shown}"):
                    use(ids)
        with pytest.raises(ValueError, match=r"exceed the area's 4 pages of 16 tokens \(a larger slots="):
            kv.retract("big", kv_cache(seq=SLOTS + 1))
        assert kv.session.stats().backups == ()


def test_restored_caches_are_built_on_the_given_device(client: HiCacheClient) -> None:
    """``device=`` places what load_prefix and resume build (the meta device stands in for an
    accelerator here: no GPU on these machines)."""
    shape = KVShape.of(llama(), torch.float32)
    tokens = prompt(tokens=40)
    model = unique_model()
    with HFKVCache(client, model_name=model, shape=shape, page_size=PAGE, slots=SLOTS) as kv:
        kv.save_prefix(tokens, kv_cache())
    with HFKVCache(client, model_name=model, shape=shape, page_size=PAGE, slots=SLOTS, device="meta") as kv:
        restored, hit = kv.load_prefix(tokens)
        assert hit == 32 and restored.layers[1].keys.device.type == "meta"
        retracted = kv.retract("req", kv_cache(seq=20))
        assert retracted is not None
        assert kv.resume(retracted).layers[0].values.device.type == "meta"
