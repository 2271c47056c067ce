"""The routes of a layer's experts sorted by expert: the one sort the expert paths share (the grouped
matmuls' `grouped.grouped_swiglu` with its combine, and DeepSpeed's dispatch)."""

from __future__ import annotations

import torch

from megatron_triroute.routing.counts import option_counts


def order_by_expert(index: torch.Tensor, num_experts: int, count_dtype: torch.dtype = torch.int64):
    """index (any shape), -1 the null expert -> (key (n,): each flattened route's expert, num_experts
    for the null one; order (n,): the routes by key, stable, null last; counts (num_experts + 1,):
    routes per key). The sort both expert paths share (this module's and DeepSpeed's dispatch)."""
    flat = index.reshape(-1)
    key = torch.where(flat >= 0, flat, num_experts)
    return key, torch.argsort(key, stable=True), option_counts(key, num_experts + 1, count_dtype)


def sort_routes(index: torch.Tensor, num_experts: int):
    """index (N, k), -1 the null expert -> (order (N k,): the routes by expert, null last, stable;
    inverse (N k,): each route's row in that order; offsets (E,) int32: the end of each expert's
    rows, the null routes' rows after the last)."""
    key, order, counts = order_by_expert(index, num_experts, torch.int32)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    offsets = counts[:num_experts].cumsum(0, dtype=torch.int32)
    return order, inverse, offsets
