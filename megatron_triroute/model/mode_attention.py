"""Per-mode attention of the relaxed path, each at the cost of the keys its mode reads.

Read ranges come from `routing.modes` (`read_start`): full reads keys 0..t, which is exactly
causal attention, so it runs on SDPA's causal fast path (FlashAttention where available) with
native GQA; local reads max(0, t - w)..t, computed blockwise at O(T (w + b)) instead of as a
masked T x T attention (`router.local_attention=flex`, and `auto` on a GPU, take FlexAttention
with a sliding-window block mask instead, `flex_local_attention`: compiled on a GPU into one fused
kernel that skips the key blocks outside the window; no backward on a CPU):

    queries in blocks of b; block i (queries i*b .. i*b + b - 1) reads the b + w keys
    i*b - w .. i*b + b - 1 (positions < 0 are padding), masked to each query's own range.

K/V are never repeated per query head: the G query heads of one kv head are stacked along the
query axis of their kv head's block (G*b queries x (b + w) keys). On a CPU nor are they copied per
block: the blocks' key windows overlap, and are strided views of one copy of K (and of V)
(`_KeyWindows`, `_key_windows`; of K and V together where they are one tensor).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..config import FLEX_MIN_D_HEAD
from ..routing.modes import FULL, LOCAL, read_start

LOCAL_QUERY_BLOCK = 16
"""Queries per block of the local mode: each block reads b + w keys for its b queries, so the
work is T (w + b) key reads against the T (w + 1) a query-exact kernel needs; a smaller block
wastes fewer, a larger one makes fewer, larger SDPA problems. 16 keeps the waste at 12% for
w = 128."""


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full mode: q (B, T, H, d), k/v (B, T, H_kv, d) -> (B, T, H, d); query t reads keys 0..t."""
    ctx = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, enable_gqa=True)  # (B, H, T, d)
    return ctx.transpose(1, 2)


@functools.lru_cache(maxsize=16)
def _local_block_mask(T: int, window: int, block: int, kv_heads: int, group: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """(1, kv_heads * n_blocks, group * block, block + w), laid out as `local_attention`'s query
    blocks: key slot j of block i holds position i*block + j - w, query row r of a kv head's block
    is the query at offset r % block of its head r // block; 0 where that query's read range
    (`read_start`) holds that key, -inf elsewhere (SDPA's own conversion of a boolean mask, done
    once per shape here instead of at every call). One mask per shape, kept: SDPA's CPU flash
    kernel takes a 4-D mask only in this batch-1, one-per-problem layout."""
    n = -(-T // block)
    w = min(window, max(T - 1, 0))  # keys before position 0 are padding either way
    base = torch.arange(n, device=device).view(n, 1, 1) * block
    t = base + torch.arange(block, device=device).view(1, block, 1)  # query positions
    s = base + torch.arange(block + w, device=device).view(1, 1, block + w) - w  # key positions
    reads = (s >= read_start(t, LOCAL, window)) & (s <= t)  # (n, block, block + w)
    mask = torch.zeros(reads.shape, dtype=dtype, device=device).masked_fill_(~reads, float("-inf"))
    mask = mask.view(1, n, 1, block, block + w).expand(kv_heads, n, group, block, block + w)
    return mask.reshape(1, kv_heads * n, group * block, block + w)


class _KeyWindows(torch.autograd.Function):
    """K or V (B, T, H_kv, d) -> the key windows of `local_attention`'s blocks, (B, H_kv * n, b + w, d):
    window h * n + i holds kv head h's positions i*b - w .. i*b + b - 1. With `parts` > 1, x holds
    that many tensors' heads end to end (the layer's written K/V: K's heads, then V's), and each
    part's windows are returned as its own output, all from one buffer.

    The windows overlap (each key is in about (w + b) / b of them), so they are not copied: x is
    copied once into a zeroed buffer laid out, per batch row, as w rows then each kv head's n * b
    positions, and the windows are its unfold over those rows (b + w rows every b, a strided view).
    A window that starts before its head's first position reads the rows in front of it (the zero
    rows, or the previous head's last positions, also across parts): positions < 0, which the mask
    leaves out, so their attention weights are exactly 0 and so is the gradient they receive.
    Backward: each row the sum of the windows that read it (`_sum_windows`; the zero gradients of
    the rows in front of a head add nothing to the previous head's)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, block: int, w: int, n: int, parts: int) -> tuple[torch.Tensor, ...]:
        B, T, H, d = x.shape
        span = n * block  # positions per kv head (T and padding to whole blocks)
        rows = w + H * span  # per batch row: w in front, then every kv head's positions
        buf = x.new_zeros(B, rows, d)
        buf.as_strided((B, T, H, d), (rows * d, d, span * d, 1), w * d).copy_(x)
        ctx.geometry = (T, H, block, w, n)
        windows = buf.unfold(1, block + w, block).transpose(2, 3)  # (B, H * n, b + w, d)
        return windows.chunk(parts, dim=1) if parts > 1 else (windows,)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        T, H, block, w, n = ctx.geometry
        B, d, span = grads[0].shape[0], grads[0].shape[-1], n * block
        rows = w + H * span
        buf = _sum_windows(grads, rows, block, grads[0].device.type == "cpu")
        return buf.as_strided((B, T, H, d), (rows * d, d, span * d, 1), w * d), None, None, None, None


def stacked_kv(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """The one (B, T, 2 H_kv, d) tensor whose heads k and v are, K's first, when they are its two
    halves (`torch.chunk` of the layer's written K/V, `quant.relaxed_kv_write`'s output); None
    otherwise, and None where that tensor is not the one autograd tracks k and v through (a base
    made inside an autograd function's forward, which tracks nothing)."""
    kv = k._base
    if kv is None or v._base is not kv:
        return None
    if (k.requires_grad or v.requires_grad) and not kv.requires_grad:
        return None
    B, T, H, d = k.shape
    halves = kv.shape == (B, T, 2 * H, d) and k.shape == v.shape and k.stride() == v.stride() == kv.stride()
    in_place = k.storage_offset() == kv.storage_offset() and v.storage_offset() == kv.storage_offset() + H * kv.stride(2)
    return kv if halves and in_place else None


def _sum_windows(grads: tuple[torch.Tensor, ...], rows: int, block: int, index_add: bool) -> torch.Tensor:
    """The gradients (B, n_w, r, d) of consecutive runs of windows of r rows every `block` rows ->
    (B, rows, d): each row the sum over the windows that read it (the backward of
    `Tensor.unfold(1, r, block)`).

    `index_add` (a CPU): one `index_add_` per run of the gradient's rows, taken in (row, window)
    order, into the rows they were read from: SDPA's CPU kernel lays the gradient out that way, so
    no copy of it is made (a third of the time of summing it by blocks, which needed one, at the
    160m shape). Otherwise, for a GPU, where `index_add_` takes atomic adds (516 us a call in bf16
    at the 160m shape on an H200): `aten.unfold_backward`, a deterministic gather of each row's
    windows."""
    B, _, r, d = grads[0].shape
    if index_add:
        buf = grads[0].new_zeros(B, rows, d)
        first = 0
        for grad in grads:
            n_w = grad.shape[1]
            src = grad.transpose(1, 2).reshape(B, r * n_w, d)
            buf.index_add_(1, _window_rows(n_w, r, block, grad.device, first), src)
            first += n_w
        return buf
    grad = grads[0] if len(grads) == 1 else torch.cat(grads, 1)
    return torch.ops.aten.unfold_backward(grad.transpose(2, 3), [B, rows, d], 1, r, block)


@functools.lru_cache(maxsize=16)
def _window_rows(n_w: int, r: int, block: int, device: torch.device, first: int = 0) -> torch.Tensor:
    """(r n_w,): the row that row i of window j was read from, j block + i, in (row, window) order,
    for the windows first .. first + n_w - 1."""
    windows = torch.arange(first, first + n_w, device=device)
    return (torch.arange(r, device=device).view(r, 1) + windows.view(1, n_w) * block).reshape(-1)


def _key_windows(x: torch.Tensor, block: int, w: int, n: int) -> torch.Tensor:
    """`_KeyWindows` as SDPA reads it. On a CPU its flash kernel reads the strided view and makes its
    K and V gradients afresh; elsewhere the windows are copied first, since a kernel that made its
    K gradient with K's strides would write overlapping windows' gradients into the same memory."""
    (windows,) = _KeyWindows.apply(x, block, w, n, 1)
    return windows if x.device.type == "cpu" else windows.contiguous()


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                    block: int = LOCAL_QUERY_BLOCK) -> torch.Tensor:
    """Local mode: q (B, T, H, d), k/v (B, T, H_kv, d) -> (B, T, H, d); query t reads keys
    max(0, t - window)..t, computed only over each query block's b + w keys (module docstring)."""
    B, T, H, d = q.shape
    H_kv = k.shape[2]
    G = H // H_kv
    block = max(1, min(block, T))
    n = -(-T // block)
    w = min(window, max(T - 1, 0))  # keys before position 0 are padding either way
    pad_q = n * block - T

    qb = (F.pad(q, (0, 0, 0, 0, 0, pad_q)) if pad_q else q).reshape(B, n, block, H_kv, G, d)  # a view when unpadded
    qb = qb.permute(0, 3, 1, 4, 2, 5).reshape(B, H_kv * n, G * block, d)  # (B, H_kv*n, G*b, d)
    mask = _local_block_mask(T, window, block, H_kv, G, q.dtype, q.device)  # (1, H_kv*n, G*b, b + w)
    kv = stacked_kv(k, v) if q.device.type == "cpu" else None
    if kv is not None:  # the layer's K and V, one tensor: their windows from one buffer
        k_windows, v_windows = _KeyWindows.apply(kv, block, w, n, 2)
    else:
        k_windows, v_windows = _key_windows(k, block, w, n), _key_windows(v, block, w, n)
    ctx = F.scaled_dot_product_attention(qb, k_windows, v_windows, attn_mask=mask)
    ctx = ctx.view(B, H_kv, n, G, block, d).permute(0, 2, 4, 1, 3, 5).reshape(B, n * block, H, d)
    return ctx[:, :T]


def flex_local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """Local mode through FlexAttention: q (B, T, H, d), k/v (B, T, H_kv, d) -> (B, T, H, d). The
    block mask skips every key block outside each query block's window, so the work is
    O(T (w + 128)) with no copy of K or V and native GQA; on a GPU the call is compiled into one
    fused kernel, forward and backward. (FlexAttention has no backward on a CPU.)"""
    T = q.shape[1]
    mask = _flex_window_mask(T, window, q.device)
    ctx = _flex(q.device.type)(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask,
                               enable_gqa=True)
    return ctx.transpose(1, 2)


@functools.lru_cache(maxsize=16)
def _flex_window_mask(T: int, window: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    def reads(b, h, q_idx, kv_idx):  # `read_start`'s local range [t - w, t] in FlexAttention's int32 indices
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= window)

    return create_block_mask(reads, None, None, T, T, device=device)


@functools.lru_cache(maxsize=None)
def _flex(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if device_type == "cuda" else flex_attention


def takes_flex(local: str, q: torch.Tensor) -> bool:
    """Whether `router.local_attention` (`local`) runs the local mode through FlexAttention for q:
    flex always; auto on a GPU at a head dim its kernel takes."""
    return local == "flex" or (local == "auto" and q.is_cuda and q.shape[-1] >= FLEX_MIN_D_HEAD)


def local_mode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                         local: str = "auto") -> torch.Tensor:
    """The local mode by `router.local_attention` (`local`): blocks, flex or auto (`takes_flex`)."""
    return flex_local_attention(q, k, v, window) if takes_flex(local, q) else local_attention(q, k, v, window)


MODE_ATTENTION = {FULL: lambda q, k, v, window, local="auto": full_attention(q, k, v), LOCAL: local_mode_attention}
"""The attention of each reading mode (`routing.modes.READING_MODES`): (q, k, v, window, local) -> ctx,
`local` the local mode's kernel (`router.local_attention`)."""
