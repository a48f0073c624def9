"""CPU copy route: wide word views, run coalescing, every gather/scatter strategy byte-exact."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest
import torch

from hicached.errors import InvalidArgument, OutOfRange
from hicached.page_arrays import SMALL_BATCH
from hicached.transfer import Medium, routes
from hicached.transfer.plan import PageCopy
from hicached.transfer.routes import CopyContext, Staging, copy_cpu_cpu, route, run_copies
from hicached.transfer.runs import MIN_RUN_PAGES, Run, few_runs, run_starts, runs
from hicached.transfer.words import word_rows


def rand_pages(n: int, *page_shape: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**15), 2**15, (n, *page_shape), dtype=torch.int16, generator=gen).view(
        torch.bfloat16
    )


def test_word_rows_of_contiguous_pages_are_int64_rows_aliasing_the_pages() -> None:
    t = rand_pages(5, 4, 2, 8)
    rows = word_rows(t)
    assert rows.dtype == torch.int64 and rows.shape == (5, 4 * 2 * 8 * 2 // 8)
    rows[3].zero_()
    assert torch.count_nonzero(t[3].view(torch.int16)) == 0


def test_word_rows_of_page_first_layer_keep_the_outer_token_stride() -> None:
    # page_first host layer view: (pages, page, H, D) with a layer stride between tokens.
    buf = rand_pages(6 * 4, 3, 2, 8)  # (tokens, layers, H, D)
    layer = buf[:, 1].view(6, 4, 2, 8)
    rows = word_rows(layer)
    assert rows.dtype == torch.int64 and rows.shape == (6, 4, 4)
    assert torch.equal(rows.view(torch.int16).flatten(1), layer.view(torch.int16).flatten(1))


def test_word_rows_fall_back_to_narrower_words_when_misaligned() -> None:
    base = rand_pages(4 * 8 + 1, 2)  # (tokens, 2) bf16 = 4-byte tokens
    shifted = base[1:].view(4, 8, 2)  # starts 4 bytes into the storage
    rows = word_rows(shifted)
    assert rows.dtype == torch.int32
    assert torch.equal(rows.view(torch.int16), shifted.view(torch.int16).flatten(1))


def test_word_rows_need_a_page_dimension() -> None:
    with pytest.raises(InvalidArgument, match="page dimension"):
        word_rows(torch.zeros(8))


def test_runs_coalesce_consecutive_pairs() -> None:
    src = np.array([3, 4, 5, 9, 10, 0], dtype=np.int64)
    dst = np.array([7, 8, 2, 3, 4, 5], dtype=np.int64)
    assert runs(src, dst) == [Run(0, 3, 7, 2), Run(2, 5, 2, 1), Run(3, 9, 3, 2), Run(5, 0, 5, 1)]
    assert runs(src) == [Run(0, 3, 3, 3), Run(3, 9, 9, 2), Run(5, 0, 0, 1)]
    assert runs(np.array([], dtype=np.int64)) == []


PATTERNS = {
    # name: (src pages, dst pages) over 64 source and 64 destination pages
    "long runs": (np.r_[10:30, 40:60], np.r_[0:20, 30:50]),
    "random into a run": (np.random.default_rng(1).permutation(64)[:40], np.r_[5:45]),
    "run into random": (np.r_[20:60], np.random.default_rng(2).permutation(64)[:40]),
    "random both": (
        np.random.default_rng(3).permutation(64)[:40],
        np.random.default_rng(4).permutation(64)[:40],
    ),
    "single page": (np.array([63]), np.array([0])),
}


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("layout", ["contiguous", "page_first_dst", "page_first_src"])
def test_cpu_copy_is_byte_exact(pattern: str, layout: str) -> None:
    sp, dp = (np.asarray(a, dtype=np.int64) for a in PATTERNS[pattern])
    src = rand_pages(64, 4, 2, 8, seed=5)
    dst_store = rand_pages(64 * 4, 3, 2, 8, seed=6)  # (tokens, layers, H, D)
    strided = dst_store[:, 2].view(64, 4, 2, 8)
    dst = strided if layout == "page_first_dst" else rand_pages(64, 4, 2, 8, seed=7)
    if layout == "page_first_src":
        src_store = rand_pages(64 * 4, 3, 2, 8, seed=8)
        src = src_store[:, 0].view(64, 4, 2, 8)
    before = dst.clone()
    copy_cpu_cpu(PageCopy(src, dst, sp, dp), CopyContext(staging_bytes=4096))
    expected = before.clone()
    expected[torch.from_numpy(dp)] = src[torch.from_numpy(sp)]
    assert torch.equal(dst.view(torch.int16), expected.view(torch.int16))


def test_cpu_copy_between_differently_aligned_tensors() -> None:
    src = rand_pages(16 * 4 + 1, 2)[1:].view(16, 4, 2)  # int32-aligned only
    dst = rand_pages(16, 4, 2, seed=9)
    sp = np.random.default_rng(5).permutation(16)[:10].astype(np.int64)
    dp = np.random.default_rng(6).permutation(16)[:10].astype(np.int64)
    expected = dst.clone()
    expected[torch.from_numpy(dp)] = src[torch.from_numpy(sp)]
    copy_cpu_cpu(PageCopy(src, dst, sp, dp), CopyContext())
    assert torch.equal(dst.view(torch.int16), expected.view(torch.int16))


def test_staging_is_reused_and_grown_only_when_needed() -> None:
    staging = Staging(1024)
    like = torch.zeros(1, 16, dtype=torch.int64)  # 128-byte rows
    a = staging.rows(8, like)
    b = staging.rows(4, like)
    assert a.data_ptr() == b.data_ptr() and staging.nbytes == 1024
    c = staging.rows(16, like)
    assert staging.nbytes == 2048 and c.shape == (16, 16)


def test_staging_is_allocated_by_the_first_copy_that_needs_it_only() -> None:
    """Runs on either side copy in one pass: a thread that only sees those never zeroes 16 MiB
    of staging (it did at its first copy: milliseconds on the first GetPages after a start)."""
    ctx = CopyContext()
    src, dst = rand_pages(16, 4, 2), rand_pages(16, 4, 2, seed=3)
    copy_cpu_cpu(PageCopy(src, dst, np.arange(8, dtype=np.int64), np.arange(8, 16, dtype=np.int64)), ctx)
    assert torch.equal(dst[8:], src[:8]) and not ctx.staging.allocated
    sp = np.random.default_rng(5).permutation(16)[:10].astype(np.int64)
    dp = np.random.default_rng(6).permutation(16)[:10].astype(np.int64)
    copy_cpu_cpu(PageCopy(src, dst, sp, dp), ctx)  # scattered on both sides: through staging
    assert ctx.staging.allocated and torch.equal(dst[torch.from_numpy(dp)], src[torch.from_numpy(sp)])


def test_route_registry() -> None:
    assert route(Medium.CPU, Medium.CPU) is copy_cpu_cpu
    with pytest.raises(InvalidArgument, match="no copy route from cpu to bogus"):
        route(Medium.CPU, "bogus")  # type: ignore[arg-type]


def test_cpu_data_plane_never_imports_cuda_module() -> None:
    code = (
        "import sys, torch, numpy as np\n"
        "import hicached.transfer as t\n"
        "from hicached.transfer.routes import run_copy, CopyContext\n"
        "from hicached.transfer.plan import PageCopy\n"
        "a = torch.zeros(4, 8); b = torch.ones(4, 8)\n"
        "run_copy(PageCopy(b, a, np.arange(4), np.arange(4)), CopyContext())\n"
        "assert a.sum() == 32\n"
        "print('hicached.transfer.cuda' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "False"


class CountingExecutor(ThreadPoolExecutor):
    """A real thread pool that counts the work handed to it."""

    submitted = 0

    def submit(self, fn: Callable[..., object], /, *args: object, **kwargs: object) -> Future[object]:
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


def test_large_scatter_split_across_helper_threads_is_byte_exact() -> None:
    rows = 2048  # int64 words = 16 KiB pages; 600 pages = 9.4 MiB, above the split size
    gen = torch.Generator().manual_seed(11)
    src = torch.randint(0, 1 << 62, (600, rows), dtype=torch.int64, generator=gen)
    dst = torch.zeros(1200, rows, dtype=torch.int64)
    dp = np.random.default_rng(12).permutation(1200)[:600].astype(np.int64)
    with CountingExecutor(3, thread_name_prefix="test-helper") as helpers:
        ctx = CopyContext(helpers=helpers, parallelism=4)
        copy_cpu_cpu(PageCopy(src, dst, np.arange(600, dtype=np.int64), dp), ctx)
        # 9.4 MiB in parts of >= 4 MiB: two parts, one of them on a helper.
        assert helpers.submitted == 1
        small = torch.zeros(1200, rows, dtype=torch.int64)
        copy_cpu_cpu(PageCopy(src[:100], small, np.arange(100, dtype=np.int64), dp[:100]), ctx)
        assert helpers.submitted == 1  # 1.6 MiB stays on the calling thread
    expected = torch.zeros_like(dst)
    expected[torch.from_numpy(dp)] = src
    assert torch.equal(dst, expected)
    assert torch.equal(small[torch.from_numpy(dp[:100])], src[:100])


def test_large_gather_into_a_run_is_split_and_byte_exact() -> None:
    gen = torch.Generator().manual_seed(13)
    src = torch.randint(0, 1 << 62, (1200, 2048), dtype=torch.int64, generator=gen)
    dst = torch.zeros(700, 2048, dtype=torch.int64)
    sp = np.random.default_rng(14).permutation(1200)[:600].astype(np.int64)
    with CountingExecutor(3) as helpers:
        copy_cpu_cpu(
            PageCopy(src, dst, sp, np.arange(50, 650, dtype=np.int64)),
            CopyContext(helpers=helpers, parallelism=2),
        )
        assert helpers.submitted == 1
    assert torch.equal(dst[50:650], src[torch.from_numpy(sp)])
    assert torch.count_nonzero(dst[:50]) == 0 and torch.count_nonzero(dst[650:]) == 0


@pytest.mark.parametrize(
    ("sp", "dp", "needle"), [([0, 9], [1, 2], "source page 9"), ([0, 1], [2, -1], "page -1")]
)
def test_out_of_range_pages_fail_before_any_write(sp: list[int], dp: list[int], needle: str) -> None:
    src = torch.ones(8, 16, dtype=torch.int64)
    dst = torch.zeros(8, 16, dtype=torch.int64)
    with pytest.raises(OutOfRange, match=needle):
        copy_cpu_cpu(
            PageCopy(src, dst, np.array(sp, dtype=np.int64), np.array(dp, dtype=np.int64)), CopyContext()
        )
    assert torch.count_nonzero(dst) == 0


def test_run_analysis_is_shared_across_layers_and_never_stale() -> None:
    """Copies of every layer share one page-array pair (analysed once per context); a new
    pair, even equal in length, is analysed afresh — results are byte-exact either way."""
    ctx = CopyContext()
    layers_src = [rand_pages(32, 4, 8, seed=s) for s in range(3)]
    layers_dst = [torch.zeros(32, 4, 8, dtype=torch.bfloat16) for _ in range(3)]
    for pairs in (([1, 2, 3, 9], [20, 21, 22, 23]), ([9, 3, 2, 1], [5, 17, 11, 30])):
        sp, dp = (np.array(x, dtype=np.int64) for x in pairs)
        for src, dst in zip(layers_src, layers_dst, strict=True):
            copy_cpu_cpu(PageCopy(src=src, dst=dst, src_pages=sp, dst_pages=dp), ctx)
        for src, dst in zip(layers_src, layers_dst, strict=True):
            assert torch.equal(dst[dp].view(torch.int16), src[sp].view(torch.int16))
    with pytest.raises(OutOfRange):  # bounds are part of the cached analysis: checked per tensor size
        copy_cpu_cpu(
            PageCopy(
                src=layers_src[0], dst=torch.zeros(8, 4, 8, dtype=torch.bfloat16), src_pages=sp, dst_pages=dp
            ),
            ctx,
        )
    ctx.close()


def test_a_large_set_of_copies_is_split_across_helpers_exactly_and_checked_first() -> None:
    """run_copies hands one part of every copy to a helper (one hand-off per set): the result
    is byte-exact, and a bad page in the helper's part is refused before anything is written."""
    rng = np.random.default_rng(3)
    srcs = [torch.randint(0, 1 << 62, (700, 2048), dtype=torch.int64) for _ in range(2)]  # 16 KiB pages
    dsts = [torch.zeros(700, 2048, dtype=torch.int64) for _ in range(2)]
    sp = rng.permutation(700)[:600].astype(np.int64)
    dp = rng.permutation(700)[:600].astype(np.int64)
    with ThreadPoolExecutor(1) as helpers:
        ctx = CopyContext(helpers=helpers, parallelism=2)
        bad_dp = dp.copy()
        bad_dp[-1] = 700  # in the helper's half
        with pytest.raises(OutOfRange):
            run_copies([PageCopy(s, d, sp, bad_dp) for s, d in zip(srcs, dsts, strict=True)], ctx)
        assert not any(bool(d.any()) for d in dsts)
        run_copies([PageCopy(s, d, sp, dp) for s, d in zip(srcs, dsts, strict=True)], ctx)
        ctx.close()
    for s, d in zip(srcs, dsts, strict=True):
        assert torch.equal(d[torch.from_numpy(dp)], s[torch.from_numpy(sp)])


def _pages_for(kind: str, n: int, total: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(source, destination) pages of ``kind``: runs on both sides (breaking every 37
    pages), a destination run, a source run, or scattered on both sides."""
    scattered = rng.permutation(total)[:n].astype(np.int64)
    if kind == "both":
        run = np.arange(n, dtype=np.int64) + np.arange(n, dtype=np.int64) // 37  # gaps: many runs
        return run, run + 1
    if kind == "dst_run":
        return scattered, np.arange(5, 5 + n, dtype=np.int64)
    if kind == "src_run":
        return np.arange(3, 3 + n, dtype=np.int64), scattered
    return scattered, rng.permutation(total)[:n].astype(np.int64)


@pytest.mark.parametrize("kind", ["both", "dst_run", "src_run", "staged"])
def test_a_set_shared_out_in_parts_is_byte_exact_for_every_copy_shape(kind: str) -> None:
    """Parts cut runs at arbitrary positions (sizes shrink towards the end): every shape of
    copy comes out byte-exact, and nothing outside the destination pages is written."""
    rng = np.random.default_rng(len(kind))
    n, total, words = 700, 760, 2048  # 16 KiB rows, 2 x 700 x 16 KiB = 21.9 MiB: many parts
    sp, dp = _pages_for(kind, n, total, rng)
    srcs = [torch.randint(0, 1 << 62, (total, words), dtype=torch.int64) for _ in range(2)]
    dsts = [torch.zeros(total, words, dtype=torch.int64) for _ in range(2)]
    with CountingExecutor(1) as helpers:
        ctx = CopyContext(staging_bytes=1 << 20, helpers=helpers, parallelism=2)
        run_copies([PageCopy(s, d, sp, dp) for s, d in zip(srcs, dsts, strict=True)], ctx)
        ctx.close()
        assert helpers.submitted == 1  # one hand-off for the whole set
    untouched = np.setdiff1d(np.arange(total), dp)
    for s, d in zip(srcs, dsts, strict=True):
        assert torch.equal(d[torch.from_numpy(dp)], s[torch.from_numpy(sp)])
        assert torch.count_nonzero(d[torch.from_numpy(untouched)]) == 0


def test_a_set_of_long_runs_under_the_limit_stays_on_the_calling_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Runs of at least MIN_PART_BYTES each, 18.8 MiB in all: one tensor copy per run on the
    calling thread (torch splits it), no hand-off; under a lower limit the same set is shared
    out. Byte-exact both ways, and nothing outside the destination runs is written."""
    srcs = [torch.randint(0, 1 << 62, (700, 2048), dtype=torch.int64) for _ in range(2)]  # 16 KiB rows
    sp = np.r_[0:300, 400:700].astype(np.int64)  # two runs of 300 rows (4.7 MiB each)
    dp = np.r_[50:350, 360:660].astype(np.int64)
    for limit, handoffs in ((routes.RUNS_INLINE_MAX_BYTES, 0), (16 << 20, 1)):
        monkeypatch.setattr(routes, "RUNS_INLINE_MAX_BYTES", limit)
        dsts = [torch.zeros(700, 2048, dtype=torch.int64) for _ in range(2)]
        with CountingExecutor(1) as helpers:
            ctx = CopyContext(helpers=helpers, parallelism=2)
            run_copies([PageCopy(s, d, sp, dp) for s, d in zip(srcs, dsts, strict=True)], ctx)
            ctx.close()
            assert helpers.submitted == handoffs
        untouched = torch.from_numpy(np.setdiff1d(np.arange(700), dp))
        for s, d in zip(srcs, dsts, strict=True):
            assert torch.equal(d[torch.from_numpy(dp)], s[torch.from_numpy(sp)])
            assert torch.count_nonzero(d[untouched]) == 0


def test_the_caller_copies_the_parts_a_busy_helper_has_not_taken() -> None:
    """The parts are taken from one list: while the only helper thread is held by other
    work, the calling thread copies the whole set (before, half of it waited for the helper)."""
    srcs = [torch.randint(0, 1 << 62, (600, 2048), dtype=torch.int64) for _ in range(2)]
    dsts = [torch.zeros(600, 2048, dtype=torch.int64) for _ in range(2)]
    sp = np.random.default_rng(5).permutation(600).astype(np.int64)
    dp = np.arange(600, dtype=np.int64)
    release = threading.Event()
    with ThreadPoolExecutor(1) as helpers:
        held = helpers.submit(release.wait, 60)
        ctx = CopyContext(helpers=helpers, parallelism=2)
        copier = threading.Thread(
            target=run_copies, args=([PageCopy(s, d, sp, dp) for s, d in zip(srcs, dsts, strict=True)], ctx)
        )
        copier.start()
        done, deadline = False, time.monotonic() + 30
        while not done and time.monotonic() < deadline:  # polls the bytes; the helper stays held
            done = all(torch.equal(d, s[torch.from_numpy(sp)]) for s, d in zip(srcs, dsts, strict=True))
        release.set()
        copier.join(timeout=60)
        assert held.result() is True and not copier.is_alive()
    assert done, "the calling thread left parts to a helper that was busy"


@pytest.mark.parametrize("n", [1, 2, 3, SMALL_BATCH - 1, SMALL_BATCH, SMALL_BATCH + 1, 200])
def test_runs_of_small_batches_in_python_are_the_numpy_runs(n: int) -> None:
    """Small batches take a Python path; it must find exactly the runs (and the None) of the
    numpy path, which larger batches take."""
    rng = np.random.default_rng(n)
    for _ in range(300):
        sp = np.cumsum(rng.choice([1, 1, 1, 2, 7], size=n)).astype(np.int64)
        dp = np.cumsum(rng.choice([1, 1, 1, 3], size=n)).astype(np.int64)
        for d in (dp, None):
            starts = run_starts(sp, d)
            ends = np.append(starts[1:], n)
            to = d if d is not None else sp
            expected = [
                Run(int(a), int(sp[a]), int(to[a]), int(b - a)) for a, b in zip(starts, ends, strict=True)
            ]
            assert runs(sp, d) == expected
            many = len(starts) > 2 and len(starts) * MIN_RUN_PAGES > n
            assert few_runs(sp, d, n=n) == (None if many else expected)
