"""Plain-PyTorch ground truth for the routed computation (Sec. axes; Alg. 1, line 4).

`reference_attention` is the relaxed training path: every query head's output is
sum_m y[m] * Attn^(m), with Attn^skip = 0, Attn^local over keys max(0, t-w)..t and Attn^full
over keys 0..t. Keys/values are whatever was *written* (already passed through the bit
head's quantiser), so skip is a read decision only: a skipping token's K/V are still read by
later tokens at its bit-width.

`hard_attention` and `hard_experts` execute only what hard decisions select, one token at a
time, so an independent FLOP counter sees exactly the work the accounting claims. They are
slow by design: faster paths (Megatron, Triton) are tested against them.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from .modes import READING_MODES, read_mask, read_start



def _repeat_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, T, H_kv, d) -> (B, T, H, d): query head h reads kv head h // (H / H_kv) (GQA)."""
    return x.repeat_interleave(n_heads // x.shape[2], dim=2)


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, modes: torch.Tensor, window: int
) -> torch.Tensor:
    """Relaxed routed attention.

    q: (B, T, H, d_h); k, v: (B, T, H_kv, d_h) as written to the cache; modes: (B, T, H, 3)
    weights over (skip, local, full) -- one-hot forward with straight-through gradients in
    training. Returns (B, T, H, d_h).
    """
    B, T, H, d = q.shape
    k = _repeat_kv(k, H).transpose(1, 2)  # (B, H, T, d)
    v = _repeat_kv(v, H).transpose(1, 2)
    scores = q.transpose(1, 2) @ k.transpose(-1, -2) / math.sqrt(d)  # (B, H, Tq, Tk)
    out = torch.zeros_like(q)
    for mode in READING_MODES:
        mask = read_mask(T, mode, window, q.device)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        ctx = (probs @ v).transpose(1, 2)  # (B, T, H, d)
        out = out + modes[..., mode, None].to(q.dtype) * ctx
    return out


def hard_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode_index: torch.Tensor, window: int
) -> torch.Tensor:
    """Executes only the selected reads: mode_index (B, T, H) ints; skip computes nothing."""
    B, T, H, d = q.shape
    group = H // k.shape[2]
    out = torch.zeros_like(q)
    for b in range(B):
        for t in range(T):
            for h in range(H):
                start = int(read_start(torch.tensor(t), mode_index[b, t, h], window))
                if start > t:
                    continue  # skip: nothing read
                keys = k[b, start : t + 1, h // group]  # (n, d)
                vals = v[b, start : t + 1, h // group]
                probs = (q[b, t, h].view(1, d) @ keys.T / math.sqrt(d)).softmax(-1)  # (1, n)
                out[b, t, h] = (probs @ vals).view(d)
    return out


def combine_experts(
    x: torch.Tensor,
    expert_index: torch.Tensor,
    expert_weight: torch.Tensor,
    experts: Sequence[Callable[[torch.Tensor], torch.Tensor]],
) -> torch.Tensor:
    """FFN_t = sum_{slots} weight * f_index(x_t), f_null = 0; every expert runs on all tokens
    (the dense reference). x: (N, d); expert_index, expert_weight: (N, k)."""
    out = torch.zeros_like(x)
    for j, f in enumerate(experts):
        w = (expert_weight * (expert_index == j)).sum(-1, keepdim=True)  # (N, 1)
        out = out + w.to(x.dtype) * f(x)
    return out


def hard_experts(
    x: torch.Tensor,
    expert_index: torch.Tensor,
    expert_weight: torch.Tensor,
    experts: Sequence[Callable[[torch.Tensor], torch.Tensor]],
) -> torch.Tensor:
    """Runs each real expert only on the tokens routed to it; the null expert never runs."""
    out = torch.zeros_like(x)
    for j, f in enumerate(experts):
        rows, slots = (expert_index == j).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        out = out.index_add(0, rows, expert_weight[rows, slots, None].to(x.dtype) * f(x[rows]))
    return out


def swiglu(w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """A SwiGLU expert f(x) = (silu(x W1) * x W3) W2 with weights (d, d_e), (d, d_e), (d_e, d)."""
    return lambda x: (F.silu(x @ w1) * (x @ w3)) @ w2
