"""Word-row views of page tensors: the shape every CPU page copy runs on.

Index ops reach memcpy speed only on wide element views (see PERF-NOTES), so a
(pages, ...) tensor is viewed as rows of 8-byte words where its layout allows. Pure
views: nothing is copied, and the result aliases its input. Kept apart from the
routes so that planning (:mod:`hicached.transfer.plan`) can compute them once per
session and pool rather than once per copy.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from hicached.errors import InvalidArgument


def word_rows(pages: torch.Tensor) -> torch.Tensor:
    """View a (pages, ...) tensor as (pages, *outer, words) with the widest word the layout allows.

    Trailing dimensions that are contiguous are merged into one row of bytes that
    is reinterpreted as int64 (or narrower when size or alignment forbid it); the
    result aliases ``pages``.
    """
    if pages.dim() < 2:
        raise InvalidArgument(f"page tensor must have a page dimension and a page body, got {pages.shape}")
    sizes, strides = list(pages.shape), list(pages.stride())
    inner, first = 1, pages.dim()
    while first > 1 and (sizes[first - 1] == 1 or strides[first - 1] == inner):
        inner *= sizes[first - 1]
        first -= 1
    # view, not flatten: the merged dimensions are contiguous (checked above), and flatten
    # costs ~10x more per call (measured 18 vs 1.7 us), paid per layer of every copy.
    rows = pages.view(*sizes[:first], inner) if first < pages.dim() else pages.unsqueeze(-1)
    nbytes = rows.element_size()
    as_bytes = rows.view(torch.uint8) if nbytes > 1 else rows
    for word, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        offset_bytes = as_bytes.storage_offset()
        if (
            as_bytes.shape[-1] % word == 0
            and offset_bytes % word == 0
            and all(s % word == 0 for s in as_bytes.stride()[:-1])
            and as_bytes.data_ptr() % word == 0
        ):
            return as_bytes.view(dtype)
    return as_bytes


def matched_rows(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Word-row views of two page tensors with equal row shapes.

    When one side is less contiguous (a page_first host pool next to a contiguous
    device buffer), the contiguous side is reshaped to the other's rows; if no such
    view exists, the element views are returned (correct, slower).
    """
    ws, wd = word_rows(src), word_rows(dst)
    if ws.shape[1:] == wd.shape[1:] and ws.dtype == wd.dtype:
        return ws, wd
    if ws.dtype == wd.dtype and ws[0].numel() == wd[0].numel():
        for a, b in ((ws, wd), (wd, ws)):
            try:
                reshaped = a.view(a.shape[0], *b.shape[1:])
            except RuntimeError:
                continue
            return (reshaped, b) if a is ws else (b, reshaped)
    return src, dst


# Word types numpy has (it has no bfloat16): rows of these can be moved by numpy, which
# copies each row with one memcpy and releases the GIL.
NUMPY_WORDS = frozenset({torch.int64, torch.int32, torch.int16, torch.uint8})


class CopyRows(NamedTuple):
    """A CPU copy's matched word rows, with what each copy would otherwise ask torch again
    (each question costs ~0.3-1 us, paid per layer of every copy): the page counts of both
    sides, whether the destination is contiguous, and numpy arrays over the same memory
    where numpy has the word type (a small copy takes ~0.4 us through numpy against ~3 us
    through torch; measured on 16 KiB rows). Views only: the result aliases the tensors."""

    src: torch.Tensor
    dst: torch.Tensor
    limits: tuple[int, int]
    dst_contiguous: bool
    arrays: tuple[np.ndarray, np.ndarray] | None


def copy_rows(src: torch.Tensor, dst: torch.Tensor) -> CopyRows:
    """:func:`matched_rows` of two CPU page tensors, as :class:`CopyRows`."""
    s, d = matched_rows(src, dst)
    arrays = (s.numpy(), d.numpy()) if s.dtype in NUMPY_WORDS and d.dtype == s.dtype else None
    return CopyRows(s, d, (s.shape[0], d.shape[0]), d.is_contiguous(), arrays)
