"""A real model served from the cache: transformers workers in separate processes, a real daemon.

Worker A prefills a prompt on a small seeded Llama (float32, CPU) and stores
its page-aligned KV prefix; worker B, another process, restores it into a new
``DynamicCache`` and continues. The reference is a full recompute in this
process with the same seeded weights.
"""

from __future__ import annotations

import signal

import pytest
import torch

from tests.engines.conftest import run_hf_worker, unique_model
from tests.engines.model import GENERATE, PAGE_SIZE, PROMPT_TOKENS, full_run, prompt, tiny_llama
from tests.support.daemon import Daemon
from tests.support.warm import Warm
from tests.support.zygote import Zygote

PREFIX = (PROMPT_TOKENS - 1) // PAGE_SIZE * PAGE_SIZE  # 96 tokens in 6 pages


@pytest.fixture(scope="module")
def reference() -> tuple[torch.Tensor, list[int]]:
    return full_run(tiny_llama(), prompt())


def assert_continues_like_a_full_run(
    report: dict[str, object], reference: tuple[torch.Tensor, list[int]]
) -> None:
    logits, tokens = reference
    assert report["hit_tokens"] == PREFIX
    got = torch.tensor(report["logits"])
    assert torch.allclose(got, logits, atol=1e-5, rtol=1e-5), float((got - logits).abs().max())
    assert report["tokens"] == tokens and len(tokens) == GENERATE


def test_worker_b_continues_from_worker_as_prefix(
    hf_workers: Zygote, daemon: Daemon, reference: tuple[torch.Tensor, list[int]]
) -> None:
    model = unique_model()
    cold = run_hf_worker(hf_workers, daemon, "continue", model)
    assert cold["hit_tokens"] == 0 and cold["cached_tokens"] == 0  # nothing cached yet: a full prefill
    assert cold["tokens"] == reference[1]
    published = run_hf_worker(hf_workers, daemon, "publish", model)
    assert published["saved_pages"] == PROMPT_TOKENS // PAGE_SIZE
    report = run_hf_worker(hf_workers, daemon, "continue", model)
    assert report["cached_tokens"] == PROMPT_TOKENS // PAGE_SIZE * PAGE_SIZE
    assert_continues_like_a_full_run(report, reference)


def test_another_models_pages_do_not_hit(hf_workers: Zygote, daemon: Daemon) -> None:
    model = unique_model()
    run_hf_worker(hf_workers, daemon, "publish", model)
    assert run_hf_worker(hf_workers, daemon, "continue", unique_model())["hit_tokens"] == 0
    # Another prompt of the same model shares no page (the first token differs).
    assert run_hf_worker(hf_workers, daemon, "continue", model, prompt_seed=2)["hit_tokens"] == 0


def test_retraction_mid_generation_gives_the_uninterrupted_tokens(
    hf_workers: Zygote, daemon: Daemon, reference: tuple[torch.Tensor, list[int]]
) -> None:
    report = run_hf_worker(hf_workers, daemon, "retract", unique_model())
    assert report["retracted_tokens"] == PROMPT_TOKENS + 9  # a partial last page included
    assert report["restored_tokens"] == PROMPT_TOKENS + 9
    assert report["tokens"] == reference[1]


def test_prefix_hits_after_worker_and_daemon_restarts(
    hf_workers: Zygote, warm: Warm, reference: tuple[torch.Tensor, list[int]]
) -> None:
    model = unique_model()
    first = warm.start()
    try:
        run_hf_worker(hf_workers, first, "publish", model)
        # Worker B, then B restarted (a new process, a new generation): both hit.
        assert_continues_like_a_full_run(run_hf_worker(hf_workers, first, "continue", model), reference)
        assert_continues_like_a_full_run(run_hf_worker(hf_workers, first, "continue", model), reference)
    finally:
        first.process.send_signal(signal.SIGTERM)
        assert first.process.wait(timeout=30) == 0
        first.stop()
    second = warm.start()
    try:
        assert_continues_like_a_full_run(run_hf_worker(hf_workers, second, "continue", model), reference)
    finally:
        second.stop()
