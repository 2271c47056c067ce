"""A layer's routes sorted by expert as one Triton launch, on CUDA tensors (or CPU tensors under
TRITON_INTERPRET=1): the values of `megatron_triroute.experts.routes.sort_routes_torch` (the
definition), as the C++ kernel `torch.ops.triroute.sort_routes` computes them on a CPU.

A counting sort, one program per key (each expert, then the null expert): the program counts the
routes of lower keys (its first place) and of its own (its expert's end, `offsets`), then walks the
routes in order, giving each of its routes the next place (a running count: stable, so the same
order as the definition's stable argsort, bit for bit, every run).
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
