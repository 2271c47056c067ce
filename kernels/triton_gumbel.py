"""The straight-through Gumbel sample of a routing axis as one Triton launch each way, on CUDA tensors
(or CPU tensors under TRITON_INTERPRET=1): `st_gumbel_triton` and `st_gumbel_backward_triton`, the
values of `megatron_triroute.routing.gumbel._StraightThroughPair`'s tensor ops (the definition), as
the C++ kernels `torch.ops.triroute.st_gumbel` / `st_gumbel_backward` compute them on a CPU:

    y~ = softmax((z + g) / tau),  y = y_cost = onehot(argmax y~)
    d z_model = y~ (d y - d y . y~) / tau,  d z = y~ (d y_cost - d y_cost . y~) / tau

One program takes ROWS rows of up to 16 options in float32. The one-hots are exact
(the first maximum, as `argmax`); the softmax and the gradients are within float32 rounding of the
definition's (Triton's exponential and sums are its own, not PyTorch's CUDA softmax).

And the expert gates (`megatron_triroute.routing.gating.top_k_gates`, the definition):
`top_k_gates_triton` (a row's k largest options, ties to the lower one, and their renormalised gates,
the definition's values) and `top_k_gates_backward_triton` (their gradient to the probabilities).
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
    """The index of each row's first maximum of v [ROWS, N] (options past the row's masked out), a
    NaN first, as torch.argmax and a stable descending sort take it (a row with no valid option: N)."""
    cols = tl.arange(0, N)[None, :]
    nan = (v != v) & valid
    v = tl.where(valid & ~nan, v, float("-inf"))
    top = tl.max(v, axis=1)[:, None]
    first_max = tl.min(tl.where((v == top) & valid, cols, N), axis=1)
    first_nan = tl.min(tl.where(nan, cols, N), axis=1)
    return tl.where(first_nan < N, first_nan, first_max)


@triton.jit
def _st_forward(z_ptr, g_ptr, y_ptr, c_ptr, s_ptr, rows, n, tau,
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
    """(y, y_cost, y~): the straight-through pair's forward (module doc)."""
    z, noise = z.contiguous(), noise.contiguous()
    n = z.shape[-1]
    rows = z.numel() // n
    y, y_cost, y_soft = torch.empty_like(z), torch.empty_like(z), torch.empty_like(z)
    if rows:
        _st_forward[(triton.cdiv(rows, ROWS),)](z, noise, y, y_cost, y_soft, rows, n, float(tau),
                                                N=triton.next_power_of_2(n), ROWS=ROWS)
    return y, y_cost, y_soft


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


@triton.jit
def _gates_forward(p_ptr, option_ptr, weight_ptr, total_ptr, rows, n, K: tl.constexpr, N: tl.constexpr,
                   ROWS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = r < rows
    cols = tl.arange(0, N)[None, :]
    valid = live[:, None] & (cols < n)
    p = tl.load(p_ptr + r.to(tl.int64)[:, None] * n + cols, mask=valid, other=0.0)
    left = valid
    total = tl.zeros((ROWS,), dtype=tl.float32)
    for j in tl.static_range(K):  # the first maximum of the options not taken yet: a stable descending sort's order
        pick = _first_argmax(p, left, N)
        chosen = tl.sum(tl.where(cols == pick[:, None], p, 0.0), axis=1)
        total = total + chosen
        tl.store(option_ptr + r.to(tl.int64) * K + j, pick.to(tl.int64), mask=live)
        left = left & (cols != pick[:, None])
    total = tl.maximum(total, 1e-20)
    tl.store(total_ptr + r, total, mask=live)
    for j in tl.static_range(K):
        pick = tl.load(option_ptr + r.to(tl.int64) * K + j, mask=live, other=0)
        chosen = tl.sum(tl.where(cols == pick[:, None], p, 0.0), axis=1)
        tl.store(weight_ptr + r.to(tl.int64) * K + j, chosen / total, mask=live)


@triton.jit
def _gates_backward(g_ptr, option_ptr, p_ptr, total_ptr, d_ptr, rows, n, K: tl.constexpr, KP: tl.constexpr,
                    ROWS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = r < rows
    ks = tl.arange(0, KP)[None, :]
    m = live[:, None] & (ks < K)
    at = r.to(tl.int64)[:, None] * K + ks
    g = tl.load(g_ptr + at, mask=m, other=0.0)
    option = tl.load(option_ptr + at, mask=m, other=0)
    total = tl.load(total_ptr + r, mask=live, other=1.0)
    w = tl.load(p_ptr + r.to(tl.int64)[:, None] * n + option, mask=m, other=0.0) / total[:, None]  # the gates
    d = (g - tl.sum(g * w, axis=1)[:, None]) / total[:, None]
    tl.store(d_ptr + r.to(tl.int64)[:, None] * n + option, d, mask=m)


def top_k_gates_triton(probs: torch.Tensor, k: int):
    """(option (..., k) int64, weight (..., k), total (..., 1)): a row's k largest options (ties to the
    lower option, a NaN first), p_S / max(sum p_S, 1e-20) and that sum; float32 rows of up to
    MAX_OPTIONS options (`megatron_triroute.routing.gating.top_k_gates`, the definition)."""
    probs = probs.contiguous()
    n = probs.shape[-1]
    rows = probs.numel() // n
    option = torch.empty(*probs.shape[:-1], k, dtype=torch.long, device=probs.device)
    weight = probs.new_empty(*probs.shape[:-1], k)
    total = probs.new_empty(*probs.shape[:-1], 1)
    if rows:
        _gates_forward[(triton.cdiv(rows, ROWS),)](probs, option, weight, total, rows, n, K=k,
                                                   N=triton.next_power_of_2(n), ROWS=ROWS)
    return option, weight, total


def top_k_gates_backward_triton(grad: torch.Tensor, option: torch.Tensor, probs: torch.Tensor,
                                total: torch.Tensor) -> torch.Tensor:
    """d probs (..., n): (d w - d w . w) / total at the chosen options (w recomputed from probs and
    total as the forward made it), 0 elsewhere."""
    k, n = option.shape[-1], probs.shape[-1]
    rows = option.numel() // k
    d = torch.zeros_like(probs)
    if rows:
        _gates_backward[(triton.cdiv(rows, ROWS),)](grad.contiguous(), option.contiguous(), probs.contiguous(),
                                                    total.contiguous(), d, rows, n, K=k, KP=triton.next_power_of_2(k),
                                                    ROWS=ROWS)
    return d
