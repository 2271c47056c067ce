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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

METADATA_BITS_PER_GROUP = 2 * 16
"""float16 scale + float16 zero per quantisation group."""


def kv_bits_per_token(bits: int, d_kv: int, group_size: int) -> int:
    """Bits one token's K and V occupy in one layer's cache, metadata included (Eq. cost, C_mem).

    2 * d_kv values at `bits` each, plus for bits < 16 one (scale, zero) pair per group of K
    and per group of V: 2 * d_kv / group_size groups.
    """
    payload = 2 * d_kv * bits
    if bits >= 16:
        return payload
    return payload + (2 * d_kv // group_size) * METADATA_BITS_PER_GROUP


def _groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """(..., H_kv, d_h) -> (..., H_kv, d_h // g, g); groups stay inside one head."""
    *lead, d_h = x.shape
    if d_h % group_size:
        raise ValueError(f"group_size={group_size} must divide the head dim {d_h} (groups never span heads)")
    return x.reshape(*lead, d_h // group_size, group_size)


def quantize_groups(x: torch.Tensor, bits: int, group_size: int):
    """Integer codes (uint8, unpacked), float16 scale and zero per group of x (..., H_kv, d_h)."""
    g = _groups(x.float(), group_size)
    return _quantize_grouped(g, g.amin(-1, keepdim=True), g.amax(-1, keepdim=True), bits)


def _quantize_grouped(g: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int):
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
    The gradient w.r.t. x is the identity (the y_ST sum to exactly 1 in the forward). All widths
    are quantised in one pass without autograd (`quantized_values`, the values `fake_quantize`
    gives, bit for bit), and the sum over widths and its backward are one batched matmul each.
    """
    return _RelaxedWrite.apply(x, bit_weights, quantized_values(x, bits, group_size))


class _RelaxedWrite(torch.autograd.Function):
    """out = y @ Q(x) per token, d out / d x = identity, d out / d y[b] = Q_b(x)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bit_weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        B, T = x.shape[:2]
        ctx.save_for_backward(values)
        ctx.weight_dtype = bit_weights.dtype
        weights = bit_weights.to(x.dtype).unsqueeze(-2)  # (B, T, 1, |bits|)
        with torch.autocast(x.device.type, enabled=False):  # the written values keep x's dtype, exactly
            return (weights @ values).view_as(x)  # (B, T, 1, H_kv * d_h)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (values,) = ctx.saved_tensors  # (B, T, |bits|, H_kv * d_h)
        B, T = grad.shape[:2]
        if not ctx.needs_input_grad[1]:
            return grad, None, None
        grad_weights = values @ grad.reshape(B, T, -1, 1)  # (B, T, |bits|, 1)
        return grad, grad_weights.squeeze(-1).to(ctx.weight_dtype), None


@torch.no_grad()
def quantized_values(x: torch.Tensor, bits: tuple[int, ...], group_size: int) -> torch.Tensor:
    """(B, T, |bits|, H_kv * d_h) in x's dtype: [Q_b(x) for b in bits] along dim 2, equal to
    `fake_quantize(x, b, group_size)` bit for bit. The widths below 16 share each group's min and
    max and are quantised together (the levels 2^b - 1 broadcast along the width axis)."""
    B, T = x.shape[:2]
    low = [b for b in bits if b < 16]
    parts: dict[int, torch.Tensor] = {}
    if low:
        grouped = _groups(x.float(), group_size).unsqueeze(2)  # (B, T, 1, H_kv, d_h // g, g)
        lo, hi = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
        levels = torch.tensor([2.0**b - 1 for b in low], device=x.device).view(-1, 1, 1, 1)
        # the arithmetic of `_quantize_grouped` and `dequantize_groups`, op for op
        scale = ((hi - lo) / levels).half().float()  # (B, T, |low|, H_kv, d_h // g, 1)
        zero = lo.half().float()
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.minimum(torch.round((grouped - zero) / safe).clamp_(min=0), levels)
        codes = torch.where(scale > 0, codes, torch.zeros_like(codes))
        q = (codes * scale + zero).to(x.dtype).view(B, T, len(low), -1)
        parts.update({b: q[:, :, i : i + 1] for i, b in enumerate(low)})
    for b in bits:
        if b >= 16:
            parts[b] = x.half().to(x.dtype).reshape(B, T, 1, -1)  # the float16 cache format
    ordered = [parts[b] for b in bits]
    return ordered[0] if len(ordered) == 1 else torch.cat(ordered, dim=2)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """(..., d) integer codes in [0, 2^bits) -> (..., d * bits / 8) uint8: 8 // bits codes per
    byte, code i of a byte at bit offset i * bits (the cache's byte layout)."""
    per_byte = 8 // bits
    grouped = codes.to(torch.int32).reshape(*codes.shape[:-1], -1, per_byte)
    shifts = torch.arange(per_byte, dtype=torch.int32, device=codes.device) * bits
    return (grouped << shifts).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_codes`: (..., n) uint8 -> (..., n * 8 / bits) int32 codes."""
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
