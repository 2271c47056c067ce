"""The routes of a layer's experts sorted by expert: the one sort the expert paths share (the grouped
matmuls' `grouped.grouped_swiglu` with its combine, and DeepSpeed's dispatch)."""

from __future__ import annotations

from typing import Callable

import torch
from triroute_kernels import HAS_TRITON, takes_cpu_kernel

from megatron_triroute.routing.counts import option_counts
from megatron_triroute.routing.kernel_check import checked_once, first_use_probe


def order_by_expert(index: torch.Tensor, num_experts: int, count_dtype: torch.dtype = torch.int64):
    """index (any shape), -1 the null expert -> (key (n,): each flattened route's expert, num_experts
    for the null one; order (n,): the routes by key, stable, null last; counts (num_experts + 1,):
    routes per key). The sort both expert paths share (this module's and DeepSpeed's dispatch)."""
    flat = index.reshape(-1)
    key = torch.where(flat >= 0, flat, num_experts)
    return key, torch.argsort(key, stable=True), option_counts(key, num_experts + 1, count_dtype)


def sort_routes_torch(index: torch.Tensor, num_experts: int):
    """`sort_routes` as tensor ops: the definition."""
    key, order, counts = order_by_expert(index, num_experts, torch.int32)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    offsets = counts[:num_experts].cumsum(0, dtype=torch.int32)
    return order, inverse, offsets, torch.div(order, index.shape[1], rounding_mode="floor")


def sort_routes(index: torch.Tensor, num_experts: int):
    """index (N, k), -1 the null expert -> (order (N k,): the routes by expert, null last, stable;
    inverse (N k,): each route's row in that order; offsets (E,) int32: the end of each expert's
    rows, the null routes' rows after the last; token (N k,): each sorted route's token, order // k).
    One kernel call where one takes the routes (a counting sort: `torch.ops.triroute.sort_routes` on
    a CPU where built, `triroute_kernels.triton_routes` on a GPU once its first use has given the
    definition's values), else `sort_routes_torch`; the same tensors either way."""
    kernel = _kernel(index, num_experts)
    return sort_routes_torch(index, num_experts) if kernel is None else kernel(index.contiguous(), num_experts)


def _kernel(index: torch.Tensor, num_experts: int) -> Callable | None:
    if index.dim() != 2 or index.dtype != torch.int64 or torch.compiler.is_compiling():
        return None
    if takes_cpu_kernel(index, (torch.int64,)):
        return torch.ops.triroute.sort_routes
    if index.is_cuda and HAS_TRITON:
        from triroute_kernels import triton_routes

        if triton_routes.fits(index, num_experts):
            return checked_once(("routes' sort", str(index.device)), lambda: _checked_triton(index.device))
    return None


def _checked_triton(device: torch.device) -> Callable | None:
    """The Triton sort once it has given the definition's tensors on a probe (every expert, an
    expert with no route, null routes, more routes than one block reads); else None, with a warning."""
    def load() -> Callable:
        from triroute_kernels.triton_routes import sort_routes_triton

        return sort_routes_triton

    def agrees(kernel: Callable) -> bool:
        index = torch.randint(-1, 5, (700, 2), generator=torch.Generator().manual_seed(0)).to(device)
        index[index == 3] = 4  # expert 3 has no route
        return all(torch.equal(a, b) for a, b in zip(kernel(index, 6), sort_routes_torch(index, 6)))

    return first_use_probe(device, "the routes' sort", load, agrees)
