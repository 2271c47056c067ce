"""Every expert of a layer in three grouped matmuls after one sort of the routes by expert.

    out[n] = sum_j weight[n, j] * w2_e(silu(w1_e x_n) * w3_e x_n),   e = index[n, j]; -1: the null expert

The N * k routes are ordered by expert (a stable sort; null routes last), the tokens gathered in that
order, and each expert's rows multiplied by its own weights in one `torch.nn.functional.grouped_mm`
per projection, reading the stacked parameters in place, with the experts' row ranges given as
device offsets.
None of this code reads a count on the host and nothing needs a capacity: no route is dropped, and
each expert computes its own routes only. On a Hopper GPU in bf16 each grouped matmul is one
CUTLASS kernel, so the layer's forward and backward never wait for the device. Elsewhere PyTorch
loops over the groups (on CUDA, in float32, it reads the offsets to do so: one wait per matmul).

Rows past the last expert's range (the null routes) are never computed by the grouped matmul, nor
read by it: their values are masked out in the combine's gather, and their gradients in the backward
of the tokens' gather, before they reach the tokens. The
combine undoes the sort with a gather and sums each token's k routes in place; the backward of
both gathers is a gather too (`_GatherRows`), so forward and backward add in a fixed order (no
atomics).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
    inverse (N k,): each route's row in that order; valid (N k, 1): sorted rows that are real
    routes; offsets (E,) int32: the end of each expert's rows)."""
    key, order, counts = order_by_expert(index, num_experts, torch.int32)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    offsets = counts[:num_experts].cumsum(0, dtype=torch.int32)
    valid = (key.index_select(0, order) < num_experts).unsqueeze(1)
    return order, inverse, valid, offsets


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype an `nn.Linear` would compute in here: autocast's, where it is on for x's device."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def grouped_layout_ok(expert_weight_shape: torch.Size, dtype: torch.dtype) -> bool:
    """Whether the grouped matmuls take this expert shape ((F, D), an nn.Linear weight) in `dtype`:
    their rows must be multiples of 16 bytes (both widths of the model recipes are multiples of 8)."""
    return all(n * dtype.itemsize % 16 == 0 for n in expert_weight_shape)


def grouped_swiglu(x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                   w2: torch.Tensor) -> torch.Tensor:
    """x (N, D), index/weight (N, k), w1, w3 (E, F, D), w2 (E, D, F): each expert's nn.Linear weights
    stacked -> (N, D) in the compute dtype (module doc)."""
    N, k = index.shape
    order, inverse, valid, offsets = sort_routes(index, w1.shape[0])
    dtype = compute_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        # null rows: read by no grouped matmul; their gradient (which none computes) is zeroed on the way back
        rows = _GatherRows.apply(x.to(dtype), torch.div(order, k, rounding_mode="floor"), inverse, k, None, valid)
        gate = F.grouped_mm(rows, w1.to(dtype).transpose(1, 2), offs=offsets)
        up = F.grouped_mm(rows, w3.to(dtype).transpose(1, 2), offs=offsets)
        y = F.grouped_mm(F.silu(gate) * up, w2.to(dtype).transpose(1, 2), offs=offsets)
        # back to (token, route), the null routes' rows (which no matmul computed) zeroed
        y = _GatherRows.apply(y, inverse, order, 1, (index >= 0).view(-1, 1), None).view(N, k, -1)
        return (y * weight.to(dtype).unsqueeze(-1)).sum(1)


class _GatherRows(torch.autograd.Function):
    """out = t.index_select(0, src), where the routes' sort makes the backward a gather too:
    `back` lists, for each of t's rows times `k`, the out row that took it (the sort's inverse
    permutation, or its order), so the gradient is grad.index_select(0, back) summed over each
    row's k copies. `index_select`'s own backward is an `index_add_`: atomic adds, slow in bf16
    and not deterministic where k > 1 rows add into one token.

    The null routes' rows are masked inside, where they need it: `keep` (out's rows, (n, 1) bool)
    zeroes the out rows it leaves out, in the forward only (their gradient goes back to rows that
    no grouped matmul reads); `keep_grad` (the same for the gradient arriving at out) zeroes
    those rows of the gradient, in the backward only (the out rows themselves are read by no
    grouped matmul). One `torch.where` each, instead of a `torch.where` in autograd's graph, whose
    backward is a second pass over the same rows."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, src: torch.Tensor, back: torch.Tensor, k: int, keep: torch.Tensor | None,
                keep_grad: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(back, keep_grad)
        ctx.k = k
        out = t.index_select(0, src)
        return out if keep is None else torch.where(keep, out, 0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back, keep_grad = ctx.saved_tensors
        if keep_grad is not None:
            grad = torch.where(keep_grad, grad, 0)
        rows = grad.index_select(0, back)
        if ctx.k > 1:
            rows = rows.view(-1, ctx.k, grad.shape[-1]).sum(1)
        return rows, None, None, None, None, None
