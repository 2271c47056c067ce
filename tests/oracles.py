"""Test-only ground truths: slow, plain PyTorch, written for reading, never run by the product.

- `reference_attention`: the relaxed routed attention (Sec. axes; Alg. 1, line 4): every query
  head's output is sum_m y[m] * Attn^(m), with Attn^skip = 0, Attn^local over keys
  max(0, t-w)..t and Attn^full over keys 0..t. Keys/values are whatever was *written* (already
  through the bit head's quantiser), so skip is a read decision only: a skipping token's K/V are
  still read by later tokens at its bit-width.
- `hard_attention`, `hard_experts`: execute only what hard decisions select, one token at a time,
  so an independent FLOP counter sees exactly the work the cost accounting claims; the inference
  engine (`inference.attention.routed_attention`, `inference.model.InferenceLayer`) is tested
  against them. `combine_experts` is the dense expert mix (every expert on every token).
- `pack_kv` / `unpack_kv`: one token-set's K or V bit-packed at one width, in the byte layout the
  cache pools store (`triroute_kernels.pool`); the pools are tested byte-equal to it.
- `reinforce_loss`: the score-function surrogate written out over all layers at once; the
  product reaches the same gradient through the reward slots (`routing.reinforce.reward_tap`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from megatron_triroute.routing.controller import RouterOutput
from megatron_triroute.routing.modes import READING_MODES, read_mask, read_start
from triroute_kernels.quant import dequantize_groups, pack_codes, quantize_groups
from megatron_triroute.routing.reinforce import RewardBaseline


# --- attention --------------------------------------------------------------------------------
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


# --- experts ----------------------------------------------------------------------------------
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


# --- the cache's byte layout --------------------------------------------------------------------
def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `routing.quant.pack_codes`: (..., n) uint8 -> (..., n * 8 / bits) int32 codes."""
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, dtype=torch.int32, device=packed.device) * bits
    codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.flatten(-2)


@dataclass
class PackedKV:
    """One token-set's K or V at one bit-width, bit-packed into bytes (the cache layout)."""

    bits: int
    shape: tuple[int, ...]
    codes: torch.Tensor
    """uint8, 8 // bits codes per byte (bits < 16), or the float16 values themselves."""
    scale: torch.Tensor | None
    zero: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        n = self.codes.numel() * self.codes.element_size()
        for t in (self.scale, self.zero):
            if t is not None:
                n += t.numel() * t.element_size()
        return n


def pack_kv(x: torch.Tensor, bits: int, group_size: int) -> PackedKV:
    """Bit-pack x (N, H_kv, d_h) at `bits` (N * H_kv * d_h * bits must be a multiple of 8)."""
    if bits >= 16:
        return PackedKV(16, tuple(x.shape), x.detach().half().contiguous(), None, None)
    codes, scale, zero = quantize_groups(x, bits, group_size)
    flat = codes.reshape(-1)
    if flat.numel() % (8 // bits):
        raise ValueError(f"{flat.numel()} codes at {bits} bits do not fill whole bytes")
    return PackedKV(bits, tuple(x.shape), pack_codes(flat, bits), scale, zero)


def unpack_kv(p: PackedKV) -> torch.Tensor:
    """Dequantised float32 tensor of shape `p.shape`."""
    if p.bits >= 16:
        return p.codes.float()
    codes = unpack_codes(p.codes, p.bits)
    *lead, d_h = p.shape
    g = d_h // p.scale.shape[-1]
    codes = codes.reshape(*lead, d_h // g, g)
    return dequantize_groups(codes, p.scale, p.zero)


# --- REINFORCE ----------------------------------------------------------------------------------
def reinforce_loss(outputs: list[RouterOutput], token_loss: torch.Tensor, baseline: RewardBaseline) -> torch.Tensor:
    """Score-function surrogate over all layers' attention and bit decisions:
    - mean_t sum_{heads} (R_t - b) log pi(a_t | z_t), R_t = -l_t (see routing/reinforce.py).

    token_loss: (B, T) per-token LM loss. Layers without REINFORCE log-probs contribute 0.
    """
    reward = -token_loss.detach()
    baseline.observe(reward)
    advantage = (reward - baseline.value.to(reward.dtype)).unsqueeze(-1)  # (B, T, 1)
    total = token_loss.new_zeros(())
    for out in outputs:
        for axis in (out.attn, out.bits):
            if axis.log_prob is None:
                continue
            lp = axis.log_prob if axis.log_prob.dim() == 3 else axis.log_prob.unsqueeze(-1)
            total = total - (advantage * lp).sum(-1).mean()
    return total
