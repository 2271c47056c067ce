"""Weighted sums of each token's candidates as one Triton launch each way, on CUDA tensors (or CPU
tensors under TRITON_INTERPRET=1), the values of the tensor ops that define them, as the C++ kernels
of `kernels/csrc/mix_ops.cpp` compute them on a CPU:

- the relaxed attention's mix of its reading modes (`megatron_triroute.model.mode_mix`, the
  definition): `mode_mix_triton`, `mode_mix_backward_triton`;

      out[b, t, h, :] = sum_m modes[b, t, h, c_m] * attn_m[b, t, h, :]
      d attn_m = grad * modes[..., c_m, None],   d modes[..., c_m] = sum_d grad * attn_m  (0 elsewhere)

  One read of each attention output and one write of the mix (the definition: a product and a
  multiply-add per mode, each a pass over the activations); one read of the gradient and of each
  output, one write of each d attn_m, backward (the definition: two passes per mode, a stack, a
  cast). The modes are cast to the outputs' dtype first, as the definition casts them; products are
  taken in float32 and rounded to the tensors' dtype as the definition's `mul` and `addcmul` round
  them (the second mode's term by a fused multiply-add, as CUDA's `addcmul` compiles; fusion is
  otherwise off). The output is laid out token-major ([t, b, h, :] contiguous, the layout the
  output projection reads), each d attn_m as attn_m.
- the experts' combine (`megatron_triroute.experts.combine`, the definition): `combine_routes_triton`,
  `combine_routes_backward_triton`;

      out[n] = sum_j weight[n, j] * (y[inverse[n k + j]] if index[n, j] >= 0 else 0)
      d y[r] = grad[n] * weight[n, j] for the route n k + j = order[r],
      d weight[n, j] = sum_d grad[n] * y[r]  (0 for a null route, whose row is never read)

  Each product rounded to y's dtype, the routes added in order in float32 and rounded once (the
  definition's `mul`, then `sum(1)`, which accumulates in float32). Without weights (every weight
  1, no product) the forward is the gradient of the tokens' gather into expert order.

d modes and d weight sum each row in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_MODES = 2
"""Attention outputs one launch mixes (the reading modes: local and full)."""

ROWS = 16
"""(b, t, h) rows a program takes."""


@triton.jit
def _row_offsets(r, T, H, sb, st, sh):
    """Element offsets of rows r (row-major over B x T x H) in a tensor of strides (sb, st, sh)."""
    h = r % H
    t = (r // H) % T
    b = r // (H * T)
    return b.to(tl.int64) * sb + t.to(tl.int64) * st + h.to(tl.int64) * sh


@triton.jit
def _mix_forward(modes_ptr, a0_ptr, a1_ptr, out_ptr, T, H, rows,
                 w_b, w_t, w_h, w_c, a0_b, a0_t, a0_h, a1_b, a1_t, a1_h, o_b, o_t, o_h, c0, c1,
                 D: tl.constexpr, M: tl.constexpr, ROWS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = r < rows
    chan = tl.arange(0, D)[None, :]
    m2 = live[:, None]
    w_row = modes_ptr + _row_offsets(r, T, H, w_b, w_t, w_h)
    a0 = tl.load(a0_ptr + _row_offsets(r, T, H, a0_b, a0_t, a0_h)[:, None] + chan, mask=m2, other=0.0)
    w0 = tl.load(w_row + c0 * w_c, mask=live, other=0.0).to(a0.dtype).to(tl.float32)[:, None]
    out = (a0.to(tl.float32) * w0).to(a0.dtype)
    if M > 1:
        a1 = tl.load(a1_ptr + _row_offsets(r, T, H, a1_b, a1_t, a1_h)[:, None] + chan, mask=m2, other=0.0)
        w1 = tl.load(w_row + c1 * w_c, mask=live, other=0.0).to(a1.dtype).to(tl.float32)[:, None]
        out = tl.fma(a1.to(tl.float32), w1, out.to(tl.float32)).to(a1.dtype)  # addcmul's: fused, one rounding
    tl.store(out_ptr + _row_offsets(r, T, H, o_b, o_t, o_h)[:, None] + chan, out, mask=m2)


@triton.jit
def _mix_backward(grad_ptr, modes_ptr, a0_ptr, a1_ptr, da0_ptr, da1_ptr, dw_ptr, T, H, rows, n_modes,
                  g_b, g_t, g_h, w_b, w_t, w_h, w_c, a0_b, a0_t, a0_h, a1_b, a1_t, a1_h,
                  d0_b, d0_t, d0_h, d1_b, d1_t, d1_h, c0, c1,
                  D: tl.constexpr, M: tl.constexpr, ROWS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = r < rows
    chan = tl.arange(0, D)[None, :]
    m2 = live[:, None]
    g = tl.load(grad_ptr + _row_offsets(r, T, H, g_b, g_t, g_h)[:, None] + chan, mask=m2, other=0.0)
    gf = g.to(tl.float32)
    w_row = modes_ptr + _row_offsets(r, T, H, w_b, w_t, w_h)
    dw_row = dw_ptr + r.to(tl.int64) * n_modes  # d modes: contiguous (B, T, H, n_modes)
    a0 = tl.load(a0_ptr + _row_offsets(r, T, H, a0_b, a0_t, a0_h)[:, None] + chan, mask=m2, other=0.0)
    w0 = tl.load(w_row + c0 * w_c, mask=live, other=0.0).to(g.dtype).to(tl.float32)[:, None]
    tl.store(da0_ptr + _row_offsets(r, T, H, d0_b, d0_t, d0_h)[:, None] + chan, (gf * w0).to(g.dtype), mask=m2)
    tl.store(dw_row + c0, tl.sum(gf * a0.to(tl.float32), axis=1), mask=live)
    if M > 1:
        a1 = tl.load(a1_ptr + _row_offsets(r, T, H, a1_b, a1_t, a1_h)[:, None] + chan, mask=m2, other=0.0)
        w1 = tl.load(w_row + c1 * w_c, mask=live, other=0.0).to(g.dtype).to(tl.float32)[:, None]
        tl.store(da1_ptr + _row_offsets(r, T, H, d1_b, d1_t, d1_h)[:, None] + chan, (gf * w1).to(g.dtype), mask=m2)
        tl.store(dw_row + c1, tl.sum(gf * a1.to(tl.float32), axis=1), mask=live)


def fits(modes: torch.Tensor, attn: tuple[torch.Tensor, ...]) -> bool:
    """Whether these tensors are the kernels' layout: 1 to MAX_MODES outputs of one shape and dtype,
    (B, T, H, d) with contiguous channels and d a power of two."""
    d = attn[0].shape[-1]
    return (0 < len(attn) <= MAX_MODES and modes.dim() == 4 and d & (d - 1) == 0
            and all(a.dim() == 4 and a.shape == attn[0].shape and a.dtype == attn[0].dtype and a.stride(-1) == 1
                    for a in attn))


def _strides3(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def mode_mix_triton(modes: torch.Tensor, attn: tuple[torch.Tensor, ...], columns: tuple[int, ...]) -> torch.Tensor:
    """out (B, T, H, d), laid out [t, b, h, :] contiguous: sum_m modes[..., columns[m], None] * attn[m]."""
    B, T, H, d = attn[0].shape
    out = attn[0].new_empty(T, B, H, d).transpose(0, 1)
    rows = B * T * H
    a1 = attn[1] if len(attn) > 1 else attn[0]
    c1 = columns[1] if len(attn) > 1 else columns[0]
    _mix_forward[(triton.cdiv(rows, ROWS),)](
        modes, attn[0], a1, out, T, H, rows, *_strides3(modes), modes.stride(3), *_strides3(attn[0]),
        *_strides3(a1), *_strides3(out), columns[0], c1, D=d, M=len(attn), ROWS=ROWS, enable_fp_fusion=False)
    return out


def mode_mix_backward_triton(grad: torch.Tensor, modes: torch.Tensor, attn: tuple[torch.Tensor, ...],
                             columns: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(d modes (B, T, H, n_modes) float32 contiguous, zero outside `columns`; d attn_m laid out as attn_m)."""
    B, T, H, d = attn[0].shape
    d_modes = torch.zeros(B, T, H, modes.shape[3], dtype=torch.float32, device=modes.device)
    d_attn = [torch.empty_like(a) for a in attn]
    rows = B * T * H
    a1 = attn[1] if len(attn) > 1 else attn[0]
    d1 = d_attn[1] if len(attn) > 1 else d_attn[0]
    c1 = columns[1] if len(attn) > 1 else columns[0]
    _mix_backward[(triton.cdiv(rows, ROWS),)](
        grad, modes, attn[0], a1, d_attn[0], d1, d_modes, T, H, rows, modes.shape[3], *_strides3(grad),
        *_strides3(modes), modes.stride(3), *_strides3(attn[0]), *_strides3(a1), *_strides3(d_attn[0]),
        *_strides3(d1), columns[0], c1, D=d, M=len(attn), ROWS=ROWS, enable_fp_fusion=False)
    return d_modes, d_attn


@triton.jit
def _combine_forward(y_ptr, inverse_ptr, index_ptr, weight_ptr, out_ptr, N, D,
                     K: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, WEIGHTED: tl.constexpr):
    n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # tokens
    live = n < N
    chan = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]  # a block of channels
    cm = chan < D
    acc = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(K):
        route = n.to(tl.int64) * K + j
        expert = tl.load(index_ptr + route, mask=live, other=-1)
        row = tl.load(inverse_ptr + route, mask=live, other=0)
        keep = live & (expert >= 0)
        y = tl.load(y_ptr + row[:, None] * D + chan, mask=keep[:, None] & cm, other=0.0)
        y = tl.where(keep[:, None], y, 0.0)  # a null route's row is never read
        if WEIGHTED:
            w = tl.load(weight_ptr + route, mask=live, other=0.0).to(y.dtype).to(tl.float32)[:, None]
            acc = acc + (y.to(tl.float32) * w).to(y.dtype).to(tl.float32)
        else:
            acc = acc + y.to(tl.float32)
    tl.store(out_ptr + n.to(tl.int64)[:, None] * D + chan, acc.to(out_ptr.dtype.element_ty), mask=live[:, None] & cm)


@triton.jit
def _combine_backward(grad_ptr, y_ptr, order_ptr, index_ptr, weight_ptr, dy_ptr, dw_ptr, R, D,
                      K: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # y's rows, in expert order
    live = r < R
    route = tl.load(order_ptr + r, mask=live, other=0)
    n = route // K
    keep = live & (tl.load(index_ptr + route, mask=live, other=-1) >= 0)
    w = tl.load(weight_ptr + route, mask=live, other=0.0)
    dot = tl.zeros((ROWS,), dtype=tl.float32)
    for c0 in range(0, D, BLOCK_D):  # the channels a block at a time
        chan = c0 + tl.arange(0, BLOCK_D)[None, :]
        cm = chan < D
        g = tl.load(grad_ptr + n[:, None] * D + chan, mask=live[:, None] & cm, other=0.0)
        gf = g.to(tl.float32)
        wg = w.to(g.dtype).to(tl.float32)[:, None]
        tl.store(dy_ptr + r.to(tl.int64)[:, None] * D + chan, (gf * wg).to(g.dtype), mask=live[:, None] & cm)
        y = tl.load(y_ptr + r.to(tl.int64)[:, None] * D + chan, mask=keep[:, None] & cm, other=0.0)
        dot += tl.sum(gf * tl.where(keep[:, None], y, 0.0).to(tl.float32), axis=1)
    tl.store(dw_ptr + route, dot, mask=live)


BLOCK_D = 256
"""Channels of a row a combine program holds at once (a model width is taken in blocks of them)."""


def combine_fits(y: torch.Tensor) -> bool:
    """Whether y is the combine kernels' layout: (routes, D) rows."""
    return y.dim() == 2


def combine_routes_triton(y: torch.Tensor, inverse: torch.Tensor, index: torch.Tensor,
                          weight: torch.Tensor | None) -> torch.Tensor:
    """out (N, D) in y's dtype: each token's routes weighted and summed (module doc); weight None:
    every weight 1 (the tokens' gather's gradient)."""
    N, K = index.shape
    y, inverse, index = y.contiguous(), inverse.contiguous(), index.contiguous()
    D = y.shape[1]
    out = y.new_empty(N, D)
    weighted = weight is not None
    block = min(BLOCK_D, triton.next_power_of_2(D))
    _combine_forward[(triton.cdiv(N, ROWS), triton.cdiv(D, block))](
        y, inverse, index, weight.contiguous() if weighted else y, out, N, D, K=K, ROWS=ROWS, BLOCK_D=block,
        WEIGHTED=weighted, enable_fp_fusion=False)
    return out


def combine_routes_backward_triton(grad: torch.Tensor, y: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor,
                                   index: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d y (routes, D) in y's dtype, d weight (N, k) in weight's dtype) (module doc)."""
    N, K = index.shape
    R, D = y.shape
    grad, y, order, index, weight = (t.contiguous() for t in (grad, y, order, index, weight))
    d_y = torch.empty_like(y)
    d_weight = torch.empty(N, K, dtype=torch.float32, device=y.device)
    _combine_backward[(triton.cdiv(R, ROWS),)](grad, y, order, index, weight, d_y, d_weight, R, D, K=K, ROWS=ROWS,
                                               BLOCK_D=min(BLOCK_D, triton.next_power_of_2(D)),
                                               enable_fp_fusion=False)
    return d_y, d_weight.to(weight.dtype)
