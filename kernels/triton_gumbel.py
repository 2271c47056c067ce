"""The straight-through Gumbel sample of a routing axis as one Triton launch each way, on CUDA tensors
(or CPU tensors under TRITON_INTERPRET=1): `st_gumbel_triton` and `st_gumbel_backward_triton`, the
values of `megatron_triroute.routing.gumbel._StraightThroughPair`'s tensor ops (the definition), as
the C++ kernels `torch.ops.triroute.st_gumbel` / `st_gumbel_backward` compute them on a CPU:

    y~ = softmax((z + g) / tau),  y = y_cost = onehot(argmax y~),  hard = argmax z
    d z_model = y~ (d y - d y . y~) / tau,  d z = y~ (d y_cost - d y_cost . y~) / tau

One program takes ROWS rows of up to 16 options in float32. The one-hots and the argmaxes are exact
(the first maximum, as `argmax`); the softmax and the gradients are within float32 rounding of the
definition's (Triton's exponential and sums are its own, not PyTorch's CUDA softmax).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 64
"""Rows a program takes."""

MAX_OPTIONS = 16
"""Options a row may have (a routing axis has a few)."""


@triton.jit
def _first_argmax(v, valid, N: tl.constexpr):
    """The index of each row's first maximum of v [ROWS, N] (options past the row's masked out)."""
    cols = tl.arange(0, N)[None, :]
    v = tl.where(valid, v, float("-inf"))
    top = tl.max(v, axis=1)[:, None]
    return tl.min(tl.where((v == top) & valid, cols, N), axis=1)


@triton.jit
def _st_forward(z_ptr, g_ptr, y_ptr, c_ptr, s_ptr, hard_ptr, rows, n, tau,
                N: tl.constexpr, ROWS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = r < rows
    cols = tl.arange(0, N)[None, :]
    valid = live[:, None] & (cols < n)
    at = r.to(tl.int64)[:, None] * n + cols
    z = tl.load(z_ptr + at, mask=valid, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + at, mask=valid, other=0.0).to(tl.float32)
    x = tl.where(valid, (z + g) / tau, float("-inf"))
    top = tl.max(x, axis=1)
    top = tl.where(live, top, 0.0)  # rows past the last: nothing is read or written there
    e = tl.where(valid, tl.exp(x - top[:, None]), 0.0)
    total = tl.sum(e, axis=1)
    y_soft = e / tl.where(live, total, 1.0)[:, None]
    pick = _first_argmax(y_soft, valid, N)
    one = tl.where(cols == pick[:, None], 1.0, 0.0)
    tl.store(s_ptr + at, y_soft, mask=valid)
    tl.store(y_ptr + at, one, mask=valid)
    tl.store(c_ptr + at, one, mask=valid)
    tl.store(hard_ptr + r, _first_argmax(z, valid, N).to(tl.int64), mask=live)


@triton.jit
def _st_backward(g1_ptr, g2_ptr, s_ptr, d1_ptr, d2_ptr, rows, n, tau, N: tl.constexpr, ROWS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = r < rows
    cols = tl.arange(0, N)[None, :]
    valid = live[:, None] & (cols < n)
    at = r.to(tl.int64)[:, None] * n + cols
    y = tl.load(s_ptr + at, mask=valid, other=0.0)
    g1 = tl.load(g1_ptr + at, mask=valid, other=0.0)
    g2 = tl.load(g2_ptr + at, mask=valid, other=0.0)
    tl.store(d1_ptr + at, y * (g1 - tl.sum(g1 * y, axis=1)[:, None]) / tau, mask=valid)
    tl.store(d2_ptr + at, y * (g2 - tl.sum(g2 * y, axis=1)[:, None]) / tau, mask=valid)


def fits(z: torch.Tensor, noise: torch.Tensor) -> bool:
    """Float32 rows of up to MAX_OPTIONS options, the noise of z's shape."""
    return (z.dtype == noise.dtype == torch.float32 and z.shape == noise.shape and z.dim() >= 1
            and 0 < z.shape[-1] <= MAX_OPTIONS)


def st_gumbel_triton(z: torch.Tensor, noise: torch.Tensor, tau: float):
    """(y, y_cost, y~, hard): the straight-through pair's forward (module doc)."""
    z, noise = z.contiguous(), noise.contiguous()
    n = z.shape[-1]
    rows = z.numel() // n
    y, y_cost, y_soft = torch.empty_like(z), torch.empty_like(z), torch.empty_like(z)
    hard = torch.empty(z.shape[:-1], dtype=torch.long, device=z.device)
    if rows:
        _st_forward[(triton.cdiv(rows, ROWS),)](z, noise, y, y_cost, y_soft, hard, rows, n, float(tau),
                                                N=triton.next_power_of_2(n), ROWS=ROWS)
    return y, y_cost, y_soft, hard


def st_gumbel_backward_triton(grad_y: torch.Tensor, grad_y_cost: torch.Tensor, y_soft: torch.Tensor, tau: float):
    """(d z_model, d z): each view's gradient through the sample's softmax and temperature."""
    g1, g2, y_soft = grad_y.contiguous(), grad_y_cost.contiguous(), y_soft.contiguous()
    n = y_soft.shape[-1]
    rows = y_soft.numel() // n
    d1, d2 = torch.empty_like(y_soft), torch.empty_like(y_soft)
    if rows:
        _st_backward[(triton.cdiv(rows, ROWS),)](g1, g2, y_soft, d1, d2, rows, n, float(tau),
                                                 N=triton.next_power_of_2(n), ROWS=ROWS)
    return d1, d2
