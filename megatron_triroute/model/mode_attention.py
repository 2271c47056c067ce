"""Per-mode attention of the relaxed path, each at the cost of the keys its mode reads.

Read ranges come from `routing.modes` (`read_start`): full reads keys 0..t, which is exactly
causal attention, so it runs on SDPA's causal fast path (FlashAttention where available) with
native GQA; local reads max(0, t - w)..t, computed blockwise at O(T (w + b)) instead of as a
masked T x T attention (`router.local_attention=flex` takes FlexAttention with a sliding-window
block mask instead, `flex_local_attention`: compiled on a GPU into one fused kernel that skips the
key blocks outside the window; no backward on a CPU):

    queries in blocks of b; block i (queries i*b .. i*b + b - 1) reads the b + w keys
    i*b - w .. i*b + b - 1 (positions < 0 are padding), masked to each query's own range.

K/V are never repeated per query head: the G query heads of one kv head are stacked along the
query axis of their kv head's block (G*b queries x (b + w) keys).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

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
def _local_block_mask(T: int, window: int, block: int, kv_heads: int, group: int,
                      device: torch.device) -> torch.Tensor:
    """(1, n_blocks * kv_heads, group * block, block + w) bool, laid out as `local_attention`'s
    query blocks: key slot j of block i holds position i*block + j - w, query row r of a kv
    head's block is the query at offset r % block of its head r // block; True where that
    query's read range (`read_start`) holds that key. One mask per shape, kept: SDPA's CPU flash
    kernel takes a 4-D mask only in this batch-1, one-per-problem layout."""
    n = -(-T // block)
    w = min(window, max(T - 1, 0))  # keys before position 0 are padding either way
    base = torch.arange(n, device=device).view(n, 1, 1) * block
    t = base + torch.arange(block, device=device).view(1, block, 1)  # query positions
    s = base + torch.arange(block + w, device=device).view(1, 1, block + w) - w  # key positions
    mask = (s >= read_start(t, LOCAL, window)) & (s <= t)  # (n, block, block + w)
    mask = mask.view(n, 1, 1, block, block + w).expand(n, kv_heads, group, block, block + w)
    return mask.reshape(1, n * kv_heads, group * block, block + w)


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                    block: int = LOCAL_QUERY_BLOCK) -> torch.Tensor:
    """Local mode: q (B, T, H, d), k/v (B, T, H_kv, d) -> (B, T, H, d); query t reads keys
    max(0, t - window)..t, computed only over each query block's b + w keys (module docstring)."""
    B, T, H, d = q.shape
    H_kv = k.shape[2]
    G = H // H_kv
    block = max(1, min(block, T))
    n = -(-T // block)
    w = min(window, max(T - 1, 0))
    pad_q = n * block - T

    def key_blocks(x):  # (B, T, H_kv, d) -> (B, n * H_kv, b + w, d), padded w in front
        x = F.pad(x, (0, 0, 0, 0, w, pad_q)).unfold(1, block + w, block)  # (B, n, H_kv, d, b + w)
        return x.transpose(-1, -2).reshape(B, n * H_kv, block + w, d)

    qb = F.pad(q, (0, 0, 0, 0, 0, pad_q)).view(B, n, block, H_kv, G, d)
    qb = qb.permute(0, 1, 3, 4, 2, 5).reshape(B, n * H_kv, G * block, d)  # (B, n*H_kv, G*b, d)
    mask = _local_block_mask(T, window, block, H_kv, G, q.device)  # (1, n*H_kv, G*b, b + w)
    ctx = F.scaled_dot_product_attention(qb, key_blocks(k), key_blocks(v), attn_mask=mask)
    ctx = ctx.view(B, n, H_kv, G, block, d).permute(0, 1, 4, 2, 3, 5).reshape(B, n * block, H, d)
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


def local_mode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                         local: str = "blocks") -> torch.Tensor:
    """The local mode by `router.local_attention` (`local`): blocks or flex."""
    return flex_local_attention(q, k, v, window) if local == "flex" else local_attention(q, k, v, window)


MODE_ATTENTION = {FULL: lambda q, k, v, window, local="blocks": full_attention(q, k, v), LOCAL: local_mode_attention}
"""The attention of each reading mode (`routing.modes.READING_MODES`): (q, k, v, window, local) -> ctx,
`local` the local mode's kernel (`router.local_attention`)."""
