"""KV-cache quantiser Q_b (Sec. axes (C)) and the relaxed K/V write (Alg. 1, line 4).

Asymmetric per-token group quantisation (KIVI-style):

    Q_b(k) = round((k - z) / s) * s + z,   s = (max(k) - min(k)) / (2^b - 1),   z = min(k),

per group of `group_size` consecutive channels of one key/value head (groups never span
heads), b = 16 meaning "store in the 16-bit cache format": Q_16(k) = float16(k), no scale or
zero. Our choices: scale and zero are stored in float16 (2 + 2 bytes per group) and the
fake-quantiser rounds them to float16 too, and at 16 bits it rounds the values themselves to
float16, so at every width the training-time values equal what the inference cache stores and
dequantises; a constant group has s = 0 and dequantises to z exactly. The gradient is
straight-through (identity w.r.t. k).

The storage arithmetic itself (group quantise, dequantise, pack) is the cache's number format and
is defined once beside the supported widths, in `triroute_kernels.quant`; this module trains on it.
"""

from __future__ import annotations

import torch
from triroute_kernels.quant import (
    METADATA_BITS_PER_GROUP,
    dequantize_groups,
    pack_codes,
    quantize_groups,
)
from triroute_kernels.quant import group_channels as _groups
from triroute_kernels.quant import quantize_grouped as _quantize_grouped

__all__ = [  # the cache format's functions are re-exported: training code and tests read them here too
    "METADATA_BITS_PER_GROUP", "dequantize_groups", "fake_quantize", "kv_bits_per_token", "pack_codes",
    "quantize_groups", "quantized_values", "relaxed_kv_write",
]


def kv_bits_per_token(bits: int, d_kv: int, group_size: int) -> int:
    """Bits one token's K and V occupy in one layer's cache, metadata included (Eq. cost, C_mem).

    2 * d_kv values at `bits` each, plus for bits < 16 one (scale, zero) pair per group of K
    and per group of V: 2 * d_kv / group_size groups.
    """
    payload = 2 * d_kv * bits
    if bits >= 16:
        return payload
    return payload + (2 * d_kv // group_size) * METADATA_BITS_PER_GROUP


def fake_quantize(x: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Q_b(x) with a straight-through gradient; bits >= 16 rounds x to float16 (the stored format)."""
    if bits >= 16:
        return x.detach().half().to(x.dtype) + (x - x.detach())  # float16(x) forward, identity gradient
    codes, scale, zero = quantize_groups(x.detach(), bits, group_size)
    q = dequantize_groups(codes, scale, zero).to(x.dtype)
    return q + (x - x.detach())  # exactly q forward, identity gradient


def relaxed_kv_write(x: torch.Tensor, bit_weights: torch.Tensor, bits: tuple[int, ...], group_size: int) -> torch.Tensor:
    """Written K (or V) = sum_b y_ST[b] * Q_b(x)  (Alg. 1, line 4).

    x: (B, T, H_kv, d_h); bit_weights: (B, T, |bits|) straight-through one-hots, so the forward
    value is the chosen Q_b(x) and the bit head receives dL/dy[b] = <dL/dx_written, Q_b(x)>.
    The gradient w.r.t. x is the identity (the y_ST sum to exactly 1 in the forward), written once
    as `x - x.detach()`; the Q_b(x) are computed without autograd, sharing each group's min and max
    across the widths (the same values `fake_quantize` gives, bit for bit).
    """
    with torch.no_grad():
        values = quantized_values(x, bits, group_size)
    weights = bit_weights.to(x.dtype)
    out = x - x.detach()
    for i, q in enumerate(values):
        out = out + weights[..., i, None, None] * q
    return out


@torch.no_grad()
def quantized_values(x: torch.Tensor, bits: tuple[int, ...], group_size: int) -> list[torch.Tensor]:
    """[Q_b(x) for b in bits] in x's dtype and shape, equal to `fake_quantize(x, b, group_size)`."""
    out: list[torch.Tensor] = []
    grouped = lo = hi = None
    for b in bits:
        if b >= 16:
            out.append(x.half().to(x.dtype))
            continue
        if grouped is None:
            grouped = _groups(x.float(), group_size)
            lo, hi = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
        out.append(dequantize_groups(*_quantize_grouped(grouped, lo, hi, b)).to(x.dtype).view_as(x))
    return out
