"""The cache's number format: the supported KV widths and the arithmetic that stores a value at each.

Asymmetric per-token group quantisation (KIVI-style), per group of `group_size` consecutive
channels of one key/value head (groups never span heads):

    codes = round((k - z) / s),   s = (max(k) - min(k)) / (2^b - 1),   z = min(k),

with s and z stored in float16 and a value dequantised as code * s + z in float32; a constant
group has s = 0 and dequantises to z exactly. b = 16 stores float16 values, no scale or zero.
Codes are packed 8 // b to a byte, code i of a byte at bit offset i * b.

This module is the one definition: the pools (`pool`), both kernels (`torch_ops`, `triton_ops`)
and training's fake quantiser (`megatron_triroute.routing.quant`, which must train on exactly
what the cache stores) all use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_BITS = (2, 4, 8, 16)
"""KV-cache widths with a storage layout and kernels (16 = float16 values, no quantisation metadata)."""

METADATA_BITS_PER_GROUP = 2 * 16
"""float16 scale + float16 zero per quantisation group."""


def group_channels(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """(..., H_kv, d_h) -> (..., H_kv, d_h // g, g); groups stay inside one head."""
    *lead, d_h = x.shape
    if d_h % group_size:
        raise ValueError(f"group_size={group_size} must divide the head dim {d_h} (groups never span heads)")
    return x.reshape(*lead, d_h // group_size, group_size)


def quantize_groups(x: torch.Tensor, bits: int, group_size: int):
    """Integer codes (uint8, unpacked), float16 scale and zero per group of x (..., H_kv, d_h)."""
    g = group_channels(x.float(), group_size)
    return quantize_grouped(g, g.amin(-1, keepdim=True), g.amax(-1, keepdim=True), bits)


def quantize_grouped(g: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int):
    """`quantize_groups` on grouped fp32 values whose per-group min and max are given."""
    levels = 2**bits - 1
    # A tensor divisor, not a Python number: CUDA turns division by a scalar into multiplication
    # by its reciprocal, which differs in the last bit from the CPU's and the Triton kernel's
    # correctly rounded quotient (and the difference survives the float16 rounding).
    scale = ((hi - lo) / torch.full_like(hi, float(levels))).half()
    zero = lo.half()
    s = scale.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.round((g - zero.float()) / safe).clamp_(0, levels)
    codes = torch.where(s > 0, codes, torch.zeros_like(codes))
    return codes.to(torch.uint8), scale.squeeze(-1), zero.squeeze(-1)


def dequantize_groups(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantize_groups`: (..., H_kv, d_h // g, g) codes -> (..., H_kv, d_h) float32."""
    x = codes.float() * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)
    return x.flatten(-2)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., d) integer codes in [0, 2^bits) -> (..., d * bits / 8) uint8: 8 // bits codes per
    byte, code i of a byte at bit offset i * bits (the cache's byte layout)."""
    per_byte = 8 // bits
    grouped = codes.to(torch.int32).reshape(*codes.shape[:-1], -1, per_byte)
    shifts = torch.arange(per_byte, dtype=torch.int32, device=codes.device) * bits
    return (grouped << shifts).sum(-1).to(torch.uint8)
