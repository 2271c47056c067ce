"""A layer's routes sorted by expert as one Triton launch, on CUDA tensors (or CPU tensors under
TRITON_INTERPRET=1): the values of `megatron_triroute.experts.routes.sort_routes_torch` (the
definition), as the C++ kernel `torch.ops.triroute.sort_routes` computes them on a CPU.

A counting sort, one program per key (each expert, then the null expert): the program counts the
routes of lower keys (its first place) and of its own (its expert's end, `offsets`), then walks the
routes in order, giving each of its routes the next place (a running count: stable, so the same
order as the definition's stable argsort, bit for bit, every run).

And the straight-through count of a token's real experts (`megatron_triroute.routing.cost`'s
`null_swap_margin_torch` / `null_swap_margin_backward_torch`, the definition):
`null_swap_margin_triton` (runs, slope q (1 - q), the weakest selected real expert) and
`null_swap_margin_backward_triton` (the logits' gradient), a program per block of tokens; the
sigmoid in float64 with Triton's exponential (within float64 rounding of PyTorch's), the rest the
definition's values exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
"""Routes a program reads at a time."""

MAX_EXPERTS = 256
"""Experts one launch sorts (a program each, plus the null expert's)."""


@triton.jit
def _key(index_ptr, r, live, E):
    idx = tl.load(index_ptr + r, mask=live, other=0)
    return tl.where(idx >= 0, idx, E)


@triton.jit
def _sort_routes(index_ptr, order_ptr, inverse_ptr, offsets_ptr, token_ptr, n, k, E, BLOCK: tl.constexpr):
    e = tl.program_id(0)
    before = tl.zeros([BLOCK], dtype=tl.int32)
    mine = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, n, BLOCK):
        r = start + tl.arange(0, BLOCK)
        live = r < n
        key = _key(index_ptr, r, live, E)
        before += (live & (key < e)).to(tl.int32)
        mine += (live & (key == e)).to(tl.int32)
    first = tl.sum(before, axis=0)
    if e < E:
        tl.store(offsets_ptr + e, first + tl.sum(mine, axis=0))
    taken = first
    for start in range(0, n, BLOCK):
        r = start + tl.arange(0, BLOCK)
        live = r < n
        hit = live & (_key(index_ptr, r, live, E) == e)
        place = taken + tl.cumsum(hit.to(tl.int32), axis=0) - 1
        tl.store(order_ptr + place, r.to(tl.int64), mask=hit)
        tl.store(inverse_ptr + r, place.to(tl.int64), mask=hit)
        tl.store(token_ptr + place, (r // k).to(tl.int64), mask=hit)
        taken += tl.sum(hit.to(tl.int32), axis=0)


def fits(index: torch.Tensor, num_experts: int) -> bool:
    """Whether the kernel takes these routes: (N, k) int64, at most MAX_EXPERTS experts, fewer than
    2^31 routes."""
    return index.dim() == 2 and index.dtype == torch.int64 and 0 < num_experts <= MAX_EXPERTS \
        and index.numel() < 2 ** 31


def sort_routes_triton(index: torch.Tensor, num_experts: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, inverse, offsets int32, token) of `sort_routes_torch`, index (N, k) int64."""
    index = index.contiguous()
    n = index.numel()
    order, inverse, token = (torch.empty(n, dtype=torch.int64, device=index.device) for _ in range(3))
    offsets = torch.zeros(num_experts, dtype=torch.int32, device=index.device)
    if n:
        _sort_routes[(num_experts + 1,)](index, order, inverse, offsets, token, n, index.shape[1], num_experts,
                                         BLOCK=BLOCK)
    return order, inverse, offsets, token


SWAP_ROWS = 64
"""Tokens a program of the null swap margin takes."""

MAX_OPTIONS = 1024
"""Expert options (the null's included) the swap margin's backward writes in one block."""


@triton.jit
def _swap_forward(z_ptr, index_ptr, runs_ptr, slope_ptr, weakest_ptr, n, E, K: tl.constexpr, ROWS: tl.constexpr):
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = t < n
    t64 = t.to(tl.int64)
    least = tl.full([ROWS], float("inf"), tl.float64)
    weakest = tl.load(index_ptr + t64 * K, mask=live, other=-1) + 1  # slot 0's option, kept if nothing is less
    real = tl.zeros([ROWS], dtype=tl.int32)
    for j in tl.static_range(K):
        sel = tl.load(index_ptr + t64 * K + j, mask=live, other=-1)
        is_real = sel >= 0
        v = tl.load(z_ptr + t64 * E + sel + 1, mask=live & is_real, other=0.0).to(tl.float64)
        better = is_real & (v < least)
        least = tl.where(better, v, least)
        weakest = tl.where(better, sel + 1, weakest)
        real += is_real.to(tl.int32)
    has_null = real < K
    x = tl.where(has_null, 0.0, least) - tl.load(z_ptr + t64 * E, mask=live, other=0.0).to(tl.float64)
    q = 1.0 / (1.0 + tl.exp(-x))
    tl.store(runs_ptr + t, real.to(tl.float64), mask=live)
    tl.store(slope_ptr + t, tl.where(has_null, 0.0, q * (1.0 - q)), mask=live)
    tl.store(weakest_ptr + t, weakest, mask=live)


@triton.jit
def _swap_backward(grad_ptr, slope_ptr, weakest_ptr, dz_ptr, n, E, ROWS: tl.constexpr, BLOCK_E: tl.constexpr):
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = t < n
    v = tl.load(grad_ptr + t, mask=live, other=0.0) * tl.load(slope_ptr + t, mask=live, other=0.0)
    w = tl.load(weakest_ptr + t, mask=live, other=0)
    at0 = tl.where(w == 0, v, 0.0) - v  # the definition's scatter at the weakest, then minus v at the null
    cols = tl.arange(0, BLOCK_E)[None, :]
    row = tl.where(cols == w[:, None], v[:, None], 0.0)
    row = tl.where(cols == 0, at0[:, None], row)
    tl.store(dz_ptr + t.to(tl.int64)[:, None] * E + cols, row.to(dz_ptr.dtype.element_ty),
             mask=live[:, None] & (cols < E))


def swap_fits(logits: torch.Tensor, index: torch.Tensor) -> bool:
    """Whether the swap margin's kernels take these tensors: logits (..., E') float32 or float64 with
    at most MAX_OPTIONS options, index (..., k) int64 with k at most 8, the same leading dims."""
    return (logits.dtype in (torch.float32, torch.float64) and index.dtype == torch.int64
            and logits.dim() == index.dim() and logits.shape[:-1] == index.shape[:-1]
            and 0 < logits.shape[-1] <= MAX_OPTIONS and 0 < index.shape[-1] <= 8)


def null_swap_margin_triton(logits: torch.Tensor, index: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(runs, slope, weakest (..., 1)) of `null_swap_margin_torch`."""
    logits, index = logits.contiguous(), index.contiguous()
    lead, E, k = index.shape[:-1], logits.shape[-1], index.shape[-1]
    runs = torch.empty(lead, dtype=torch.float64, device=logits.device)
    slope = torch.empty_like(runs)
    weakest = torch.empty(*lead, 1, dtype=torch.int64, device=logits.device)
    n = runs.numel()
    if n:
        _swap_forward[(triton.cdiv(n, SWAP_ROWS),)](logits, index, runs, slope, weakest, n, E, K=k, ROWS=SWAP_ROWS)
    return runs, slope, weakest


def null_swap_margin_backward_triton(grad: torch.Tensor, slope: torch.Tensor, weakest: torch.Tensor, options: int,
                                     dtype: torch.dtype) -> torch.Tensor:
    """The logits' gradient (..., options) in `dtype` of `null_swap_margin_backward_torch`."""
    dz = torch.empty(*slope.shape, options, dtype=dtype, device=slope.device)
    n = slope.numel()
    if n:
        _swap_backward[(triton.cdiv(n, SWAP_ROWS),)](grad.contiguous(), slope, weakest, dz, n, options, ROWS=SWAP_ROWS,
                                                     BLOCK_E=triton.next_power_of_2(options))
    return dz
