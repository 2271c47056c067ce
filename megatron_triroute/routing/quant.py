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

from typing import Callable

import torch
from triroute_kernels import HAS_TRITON, takes_cpu_kernel
from triroute_kernels.quant import (
    METADATA_BITS_PER_GROUP,
    dequantize_groups,
    pack_codes,
    quantize_groups,
)
from triroute_kernels.quant import group_channels as _groups

from .device_values import device_constant
from .kernel_check import checked_once, first_use_check, first_use_probe

__all__ = [  # the cache format's functions are re-exported: training code and tests read them here too
    "METADATA_BITS_PER_GROUP", "dequantize_groups", "fake_quantize", "kv_bits_per_token", "pack_codes",
    "quantize_groups", "quantized_values", "quantized_values_torch", "relaxed_kv_write",
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


def relaxed_kv_write(x: torch.Tensor, bit_weights: torch.Tensor, bits: tuple[int, ...], group_size: int,
                     quantize: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """Written K (or V) = sum_b y_ST[b] * Q_b(x)  (Alg. 1, line 4).

    x: (B, T, H_kv, d_h); bit_weights: (B, T, |bits|) straight-through one-hots, so the forward
    value is the chosen Q_b(x) and the bit head receives dL/dy[b] = <dL/dx_written, Q_b(x)>.
    The gradient w.r.t. x is the identity (the y_ST sum to exactly 1 in the forward). All widths
    are quantised in one pass without autograd (`quantized_values`, the values `fake_quantize`
    gives, bit for bit), and the sum over widths and its backward are one batched matmul each.
    `quantize`: `quantized_values` (None) or its compiled twin (`routing.compiled`).
    """
    values = (quantize or quantized_values)(x, bits, group_size)
    return _RelaxedWrite.apply(x, bit_weights, values)


class _RelaxedWrite(torch.autograd.Function):
    """out = y @ Q(x) per token, d out / d x = identity, d out / d y[b] = Q_b(x). The batched
    matmuls below are the definition; where a kernel takes the tensors (`written_kernels`) the sum
    and its gradient are one call each instead."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bit_weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        B, T = x.shape[:2]
        ctx.save_for_backward(values)
        ctx.weight_dtype = bit_weights.dtype
        kernels = written_kernels(values, bit_weights) if values.shape[2] > 1 else None
        ctx.backward_kernel = kernels[1] if kernels is not None else None
        if kernels is not None:
            return kernels[0](values, bit_weights, list(x.shape))
        weights = bit_weights.to(x.dtype).unsqueeze(-2)  # (B, T, 1, |bits|)
        with torch.autocast(x.device.type, enabled=False):  # the written values keep x's dtype, exactly
            if values.shape[2] == 1:  # one width (Dense, KV-quant): a scale, not a sum over widths
                return (weights[..., 0] * values[:, :, 0]).view_as(x)
            # written into a tensor of x's shape, not returned as a view of the product: a view
            # taken of the output (k and v, its halves) then has the output itself as its base,
            # the tensor autograd tracks (`model.mode_attention.stacked_kv`)
            out = x.new_empty(x.shape)
            torch.matmul(weights, values, out=out.view(B, T, 1, -1))  # (B, T, 1, H_kv * d_h)
            return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (values,) = ctx.saved_tensors  # (B, T, |bits|, H_kv * d_h)
        B, T = grad.shape[:2]
        if not ctx.needs_input_grad[1]:
            return grad, None, None
        if ctx.backward_kernel is not None and grad.dtype == values.dtype:
            return grad, ctx.backward_kernel(values, grad).to(ctx.weight_dtype), None
        grad_weights = values @ grad.reshape(B, T, -1, 1)  # (B, T, |bits|, 1)
        return grad, grad_weights.squeeze(-1).to(ctx.weight_dtype), None


WrittenKernels = tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]


def written_kernels(values: torch.Tensor, bit_weights: torch.Tensor) -> WrittenKernels | None:
    """(forward, backward) kernels of the write's sum over widths for these tensors: the C++ kernels
    `torch.ops.triroute.relaxed_write` / `relaxed_write_backward` on a CPU (float32, where built),
    the Triton kernels of `triroute_kernels.triton_quant` on a GPU (once their first use has given
    the matmuls' values); None where the matmuls serve (under torch.compile as well)."""
    if takes_cpu_kernel(values) and bit_weights.dtype == torch.float32:
        return torch.ops.triroute.relaxed_write, torch.ops.triroute.relaxed_write_backward
    if values.is_cuda and HAS_TRITON and not torch.compiler.is_compiling():
        key = ("relaxed write's sum", str(values.device), values.dtype, bit_weights.dtype, values.shape[2])
        return checked_once(key, lambda: checked_write_kernels(values.device, values.dtype, bit_weights.dtype,
                                                                values.shape[2]))
    return None


def checked_write_kernels(device: torch.device, dtype: torch.dtype, weight_dtype: torch.dtype,
                          widths: int) -> WrittenKernels | None:
    """The Triton kernels of the write's sum once they have given the definition's values on a probe:
    straight-through one-hots (what training writes with) exactly, d y within float32 rounding of
    the exact sums; else None with a warning, and the matmuls serve."""
    def load() -> WrittenKernels:
        from triroute_kernels.triton_quant import relaxed_write_backward_triton, relaxed_write_triton

        return relaxed_write_triton, relaxed_write_backward_triton

    def agrees(kernels: WrittenKernels) -> bool:
        gen = torch.Generator().manual_seed(0)
        values = torch.randn(2, 3, widths, 24, generator=gen).to(device, dtype)
        y = torch.nn.functional.one_hot(torch.randint(0, widths, (2, 3), generator=gen), widths).to(device, weight_dtype)
        grad = torch.randn(2, 3, 2, 12, generator=gen).to(device, dtype)
        want = (y.to(dtype).unsqueeze(-2) @ values).view(2, 3, 2, 12)
        exact = (values.double() @ grad.double().reshape(2, 3, -1, 1)).squeeze(-1)
        return (torch.equal(kernels[0](values, y, [2, 3, 2, 12]), want)
                and torch.allclose(kernels[1](values, grad).double(), exact, rtol=1e-5, atol=1e-5))

    return first_use_probe(device, "the relaxed K/V write's sum", load, agrees)


@torch.no_grad()
def quantized_values(x: torch.Tensor, bits: tuple[int, ...], group_size: int) -> torch.Tensor:
    """(B, T, |bits|, H_kv * d_h) in x's dtype: [Q_b(x) for b in bits] along dim 2, equal to
    `fake_quantize(x, b, group_size)` bit for bit. On a CPU, for float32 x, the C++ kernel
    (`torch.ops.triroute.quantized_values`, where built) computes them in one pass; on a GPU the
    Triton kernel (`triroute_kernels.triton_quant`, once its first-use check has passed for the
    layout); under torch.compile, and elsewhere, the tensor chain (`quantized_values_torch`) does."""
    if takes_cpu_kernel(x):
        return torch.ops.triroute.quantized_values(x, list(bits), group_size)
    if x.is_cuda and not torch.compiler.is_compiling():
        kernel = _triton_values(x, tuple(bits), group_size)
        if kernel is not None:
            return kernel(x, bits, group_size)
    return quantized_values_torch(x, bits, group_size)


def _triton_values(x: torch.Tensor, bits: tuple[int, ...], group_size: int) -> Callable[..., torch.Tensor] | None:
    """The Triton kernel for x's device, dtype and layout at these widths, checked at its first use
    (`first_use_check`, on two tokens of x's layout); None where triton is missing or the layout is
    not the kernel's."""
    if not HAS_TRITON:
        return None
    from triroute_kernels import triton_quant

    if not triton_quant.fits(x, bits, group_size):
        return None
    layout = (x.dtype, x.shape[-2], x.shape[-1], bits, group_size)
    return checked_once(("relaxed write values", str(x.device), *layout),
                        lambda: checked_values_kernel(x.device, *layout))


def checked_values_kernel(device: torch.device, dtype: torch.dtype, kv_heads: int, head_dim: int,
                          bits: tuple[int, ...], group_size: int) -> Callable[..., torch.Tensor] | None:
    """`triton_quant.quantized_values_triton` once it has given the chain's values on a probe of
    this layout: two tokens with a constant group, rounding ties and a wide range."""
    def load():
        from triroute_kernels.triton_quant import quantized_values_triton

        return quantized_values_triton

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, kv_heads, head_dim, generator=gen) * 2.5
    x[0, 0, 0, :group_size] = 0.25  # a constant group: scale 0
    x[0, 1, 0, :group_size] = torch.arange(group_size) * 0.5  # codes on rounding ties at some widths
    return first_use_check(device, load, quantized_values_torch, (x.to(device, dtype), bits, group_size),
                           "the relaxed K/V write's values")


@torch.no_grad()
def quantized_values_torch(x: torch.Tensor, bits: tuple[int, ...], group_size: int) -> torch.Tensor:
    """`quantized_values` as tensor ops: the definition. The widths below 16 share each group's
    min and max and are quantised together (the levels 2^b - 1 broadcast along the width axis)."""
    B, T = x.shape[:2]
    low = [b for b in bits if b < 16]
    parts: dict[int, torch.Tensor] = {}
    if low:
        grouped = _groups(x.float(), group_size).unsqueeze(2)  # (B, T, 1, H_kv, d_h // g, g)
        lo, hi = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
        levels = device_constant([2.0**b - 1 for b in low], torch.float32, x.device).view(-1, 1, 1, 1)
        # the arithmetic of `triroute_kernels.quant.quantize_grouped` and `dequantize_groups`, op for op,
        # in place on one buffer of every width's values
        scale = ((hi - lo) / levels).half().float()  # (B, T, |low|, H_kv, d_h // g, 1)
        zero = lo.half().float()
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = ((grouped - zero) / safe).round_().clamp_(min=0)  # (B, T, |low|, H_kv, d_h // g, g)
        torch.minimum(q, levels, out=q)
        # A constant group (scale 0) stores code 0; here any finite code gives the same value:
        # code * 0 + zero = zero, bit for bit, so the stored codes' select is not needed.
        q = q.mul_(scale).add_(zero).to(x.dtype).view(B, T, len(low), -1)
        parts.update({b: q[:, :, i : i + 1] for i, b in enumerate(low)})
    for b in bits:
        if b >= 16:
            parts[b] = x.half().to(x.dtype).reshape(B, T, 1, -1)  # the float16 cache format
    ordered = [parts[b] for b in bits]
    return ordered[0] if len(ordered) == 1 else torch.cat(ordered, dim=2)

