"""A CPU model's weights on transparent huge pages.

A decode step streams every weight it uses from memory (docs/inference.md). On 4 KiB pages the
160m shape's 1.27 GB of weights are 310,000 pages, a translation miss every 64 cache lines. Placed in
one buffer aligned to 2 MiB and advised as huge pages (`madvise(MADV_HUGEPAGE)` before its first
touch, so the kernel backs it with 2 MiB pages as it faults it in), they are 610: a decode step took
0.94 of its time at batch 8 and 0.96 at batch 1 (`benchmarks/profile_decode.py --against-base-pages`).

Linux only, and only where transparent huge pages are not off
(`/sys/kernel/mm/transparent_hugepage/enabled` reads `always` or `madvise`); elsewhere nothing moves.
The parameters become views of the one buffer: their values, shapes and dtypes are unchanged, and
the model is for serving (a training engine keeps its own buffers).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from pathlib import Path

import torch
from torch import nn

HUGE_PAGE = 2 * 2**20
"""x86-64's and arm64's (4 KiB base pages) transparent huge page: 2 MiB."""

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MADV_HUGEPAGE = 14
ALIGN = 64
"""Each tensor's start in the buffer: a cache line."""


def thp_mode(setting: Path = THP_SETTING) -> str | None:
    """The kernel's transparent huge page mode (`always`, `madvise` or `never`, the bracketed word
    of `setting`), or None where there is none (not Linux, or no such file)."""
    try:
        text = setting.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


@functools.lru_cache(maxsize=1)
def _madvise():
    """libc's madvise, looked up once (`find_library` runs `ldconfig`)."""
    madvise = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def _madvise_huge(address: int, length: int) -> bool:
    return _madvise()(address, length, MADV_HUGEPAGE) == 0


def huge_page_buffer(nbytes: int) -> tuple[torch.Tensor, int]:
    """(a uint8 CPU tensor, offset): `nbytes` bytes from `offset` on, starting on a 2 MiB boundary
    and advised as huge pages before anything touched them. The advice is a request: the kernel may
    back the range with base pages (no free 2 MiB block), which changes speed, never values."""
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE  # whole huge pages
    buffer = torch.empty(span + HUGE_PAGE, dtype=torch.uint8)
    offset = -buffer.data_ptr() % HUGE_PAGE
    _madvise_huge(buffer.data_ptr() + offset, span)
    return buffer, offset


def huge_pages_available() -> bool:
    """Whether this process can ask for transparent huge pages: Linux with the mode not `never`."""
    return sys.platform.startswith("linux") and thp_mode() in ("always", "madvise")


def _views(specs: list[tuple[torch.Size, torch.dtype]]):
    """One `huge_page_buffer` for tensors of these (shape, dtype); yields, one by one, a view of it of
    each shape and dtype (uninitialised), each starting on a cache line. It holds no tensor of the
    caller's: one the caller lets go is freed at once."""
    sizes = [torch.Size(shape).numel() * dtype.itemsize for shape, dtype in specs]
    offsets, end = [], 0
    for nbytes in sizes:
        offsets.append(end)
        end += -(-nbytes // ALIGN) * ALIGN
    buffer, base = huge_page_buffer(end)
    for (shape, dtype), offset, nbytes in zip(specs, offsets, sizes):
        yield buffer[base + offset:base + offset + nbytes].view(dtype).view(shape)


def huge_page_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` (CPU, contiguous) in one `huge_page_buffer`, each starting on a cache
    line; the tensors themselves where huge pages are not available."""
    if not huge_pages_available() or not tensors:
        return list(tensors)
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        raise ValueError("huge_page_copies takes contiguous CPU tensors")
    with torch.no_grad():
        return [view.copy_(t) for t, view in zip(tensors, _views([(t.shape, t.dtype) for t in tensors]))]


def _owns_storage(t: torch.Tensor) -> bool:
    """Whether `t` is its storage, whole and contiguous: a view of a larger storage (which another
    tensor may share) stays where it is, since a copy would end the sharing."""
    return t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def place_on_huge_pages(model: nn.Module, min_bytes: int = HUGE_PAGE) -> int:
    """Move `model`'s CPU parameters of `min_bytes` or more (the ones a decode step streams) that own
    their storage (`_owns_storage`) into one buffer on huge pages, each a view of it with its own values. One parameter at a time:
    its old storage is let go as its copy is made, and the buffer's pages are only backed as they are
    written, so the process holds the weights about once plus one parameter, not twice.
    Returns the bytes moved: 0 where huge pages are not available or nothing qualifies."""
    if not huge_pages_available():
        return 0
    params = [p for p in model.parameters()  # each tensor once (a tied weight is one parameter)
              if p.device.type == "cpu" and _owns_storage(p) and p.numel() * p.element_size() >= min_bytes]
    with torch.no_grad():
        for p, view in zip(params, _views([(p.shape, p.dtype) for p in params])):
            p.data = view.copy_(p.data)
    return sum(p.numel() * p.element_size() for p in params)
