"""The relaxed K/V write's values as one Triton launch: `quantized_values_triton`, every width's
Q_b(x) of `megatron_triroute.routing.quant.quantized_values_torch` (the definition), bit for bit, on
CUDA tensors (or CPU tensors under TRITON_INTERPRET=1).

Per group of GROUP channels of one (token, kv head) row, each width b < 16 takes the cache's
arithmetic (`triton_ops.group_scale_zero`, `group_codes`, as `quantize_row`): scale = half((max - min) / (2^b - 1)), zero = half(min),
code = clamp(round_half_even((x - zero) / scale), 0, 2^b - 1) (0 where scale is 0), value =
code * scale + zero, then x's dtype; b = 16 is float16(x). One read of x, one write of the values:
the tensor chain makes about fifteen passes over a buffer of every width's values. The launch turns
off Triton's multiply-add fusion, so that code * scale + zero rounds twice, as the chain does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_ops import _pow2, group_codes, group_scale_zero

MAX_WIDTHS = 4
"""Widths one launch writes (the bit options of a router)."""


@triton.jit
def _width_values(x, lo, hi, BITS: tl.constexpr):
    """[R, NG, GROUP] float32 values of width BITS for x [R, NG, GROUP] with its groups' range."""
    if BITS >= 16:
        return x.to(tl.float16).to(tl.float32)
    LEVELS: tl.constexpr = (1 << BITS) - 1
    scale16, zero16 = group_scale_zero(lo, hi, LEVELS)
    s = scale16.to(tl.float32)[:, :, None]
    z = zero16.to(tl.float32)[:, :, None]
    return group_codes(x, s, z, LEVELS) * s + z  # a constant group: any code gives z, as the chain's


@triton.jit
def _to_out(v, dtype, BF16: tl.constexpr):
    """float32 v in the output's dtype, rounded to nearest even (for bfloat16 by its bits: the
    interpreter's conversion truncates)."""
    if BF16:
        u = v.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        v = tl.where(v != v, v, u.to(tl.float32, bitcast=True))  # now exact in bfloat16
    return v.to(dtype)


@triton.jit
def _quantized_values_kernel(x_ptr, out_ptr, rows, H_KV,
                             D: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, NB: tl.constexpr, BF16: tl.constexpr,
                             BITS0: tl.constexpr, BITS1: tl.constexpr, BITS2: tl.constexpr, BITS3: tl.constexpr):
    NG: tl.constexpr = D // GROUP
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (token, kv head) rows
    live = r < rows
    chan = tl.arange(0, NG)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [NG, GROUP]
    m = live[:, None, None]
    x = tl.load(x_ptr + r.to(tl.int64)[:, None, None] * D + chan[None, :, :], mask=m, other=0.0).to(tl.float32)
    lo = tl.min(x, axis=2)  # [ROWS, NG]
    hi = tl.max(x, axis=2)
    token = r.to(tl.int64) // H_KV
    at = token[:, None, None] * (NB * H_KV * D) + (r.to(tl.int64) % H_KV)[:, None, None] * D + chan[None, :, :]
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + at, _to_out(_width_values(x, lo, hi, BITS0), dtype, BF16), mask=m)
    if NB > 1:
        tl.store(out_ptr + at + H_KV * D, _to_out(_width_values(x, lo, hi, BITS1), dtype, BF16), mask=m)
    if NB > 2:
        tl.store(out_ptr + at + 2 * H_KV * D, _to_out(_width_values(x, lo, hi, BITS2), dtype, BF16), mask=m)
    if NB > 3:
        tl.store(out_ptr + at + 3 * H_KV * D, _to_out(_width_values(x, lo, hi, BITS3), dtype, BF16), mask=m)


def fits(x: torch.Tensor, bits: tuple[int, ...], group_size: int) -> bool:
    """Whether the kernel takes x (B, T, H_kv, d_h) at these widths: d_h and the group size powers
    of two, the group dividing d_h, at most MAX_WIDTHS widths, a float32, bfloat16 or float16 x."""
    d = x.shape[-1]
    return (x.dim() == 4 and _pow2(d) and _pow2(group_size) and d % group_size == 0 and 0 < len(bits) <= MAX_WIDTHS
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16))


def quantized_values_triton(x: torch.Tensor, bits: tuple[int, ...], group_size: int, rows_per_program: int = 16) -> torch.Tensor:
    """(B, T, |bits|, H_kv * d_h) in x's dtype from x (B, T, H_kv, d_h): `quantized_values_torch`'s
    values in one launch (module doc). The layout must `fits`."""
    if not fits(x, bits, group_size):
        raise ValueError(f"quantized_values_triton: x {tuple(x.shape)} {x.dtype} at widths {bits}, group "
                         f"{group_size} is outside the kernel's layout (`fits`); use quantized_values_torch")
    B, T, H_kv, d = x.shape
    out = torch.empty(B, T, len(bits), H_kv * d, dtype=x.dtype, device=x.device)
    rows = B * T * H_kv
    if rows == 0:
        return out
    widths = list(bits) + [bits[-1]] * (MAX_WIDTHS - len(bits))
    _quantized_values_kernel[(triton.cdiv(rows, rows_per_program),)](
        x.detach().contiguous(), out, rows, H_kv, D=d, GROUP=group_size, ROWS=rows_per_program, NB=len(bits),
        BF16=x.dtype == torch.bfloat16,
        BITS0=widths[0], BITS1=widths[1], BITS2=widths[2], BITS3=widths[3], enable_fp_fusion=False)
    return out


@triton.jit
def _relaxed_write_kernel(values_ptr, weights_ptr, out_ptr, rows, D, NB: tl.constexpr, BLOCK: tl.constexpr,
                          ROWS: tl.constexpr):
    n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (b, t) rows
    live = n < rows
    chan = tl.arange(0, BLOCK)[None, :]
    m = live[:, None] & (chan < D)
    base = values_ptr + n.to(tl.int64)[:, None] * (NB * D) + chan
    v0 = tl.load(base, mask=m, other=0.0)
    w0 = tl.load(weights_ptr + n.to(tl.int64) * NB, mask=live, other=0.0).to(v0.dtype).to(tl.float32)[:, None]
    acc = v0.to(tl.float32) * w0
    for b in tl.static_range(1, NB):
        vb = tl.load(base + b * D, mask=m, other=0.0).to(tl.float32)
        wb = tl.load(weights_ptr + n.to(tl.int64) * NB + b, mask=live, other=0.0).to(v0.dtype).to(tl.float32)[:, None]
        acc = tl.fma(vb, wb, acc)
    tl.store(out_ptr + n.to(tl.int64)[:, None] * D + chan, acc.to(v0.dtype), mask=m)


@triton.jit
def _relaxed_write_backward_kernel(values_ptr, grad_ptr, dw_ptr, rows, D, NB: tl.constexpr, BLOCK: tl.constexpr,
                                   ROWS: tl.constexpr):
    n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = n < rows
    chan = tl.arange(0, BLOCK)[None, :]
    m = live[:, None] & (chan < D)
    g = tl.load(grad_ptr + n.to(tl.int64)[:, None] * D + chan, mask=m, other=0.0).to(tl.float32)
    for b in tl.static_range(NB):
        v = tl.load(values_ptr + n.to(tl.int64)[:, None] * (NB * D) + b * D + chan, mask=m, other=0.0)
        tl.store(dw_ptr + n.to(tl.int64) * NB + b, tl.sum(v.to(tl.float32) * g, axis=1), mask=live)


def _write_rows(D: int, rows_per_program: int | None) -> int:
    """(b, t) rows a write program takes: about 4,096 values of a row block in registers."""
    return rows_per_program or max(1, min(16, 4096 // triton.next_power_of_2(D)))


def relaxed_write_triton(values: torch.Tensor, weights: torch.Tensor, shape,
                         rows_per_program: int | None = None) -> torch.Tensor:
    """The written values (`shape`, holding (B, T, D)) from values (B, T, widths, D) and weights (B, T, widths)."""
    B, T, nb, D = values.shape
    out = values.new_empty(shape)
    rows = B * T
    rows_per_program = _write_rows(D, rows_per_program)
    if rows:
        _relaxed_write_kernel[(triton.cdiv(rows, rows_per_program),)](
            values.contiguous(), weights.contiguous(), out, rows, D, NB=nb, BLOCK=triton.next_power_of_2(D),
            ROWS=rows_per_program, enable_fp_fusion=False)
    return out


def relaxed_write_backward_triton(values: torch.Tensor, grad: torch.Tensor,
                                  rows_per_program: int | None = None) -> torch.Tensor:
    """d y (B, T, widths) float32: each width's values dotted with the written values' gradient."""
    B, T, nb, D = values.shape
    d_w = torch.empty(B, T, nb, dtype=torch.float32, device=values.device)
    rows = B * T
    rows_per_program = _write_rows(D, rows_per_program)
    if rows:
        _relaxed_write_backward_kernel[(triton.cdiv(rows, rows_per_program),)](
            values.contiguous(), grad.contiguous(), d_w, rows, D, NB=nb, BLOCK=triton.next_power_of_2(D),
            ROWS=rows_per_program, enable_fp_fusion=False)
    return d_w
