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
read by it: the combine selects them out (`combine.CombineRoutes`), and the backward of the tokens'
gather zeroes their gradients before they reach the tokens. The combine undoes the sort, weights and
sums each token's k routes (one kernel call each way where one is built); the backward of the tokens'
gather is a gather too (`_GatherRows`), so forward and backward add in a fixed order (no atomics).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .combine import CombineRoutes, combine_kernels, combine_torch
from .routes import sort_routes


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
    order, inverse, offsets, token = sort_routes(index, w1.shape[0])
    dtype = compute_dtype(x)
    with torch.autocast(x.device.type, enabled=False):
        # null rows: read by no grouped matmul; their gradient (which none computes) is zeroed on the way back
        rows = _GatherRows.apply(x.to(dtype), token, inverse, index)
        gate = F.grouped_mm(rows, w1.to(dtype).transpose(1, 2), offs=offsets)
        up = F.grouped_mm(rows, w3.to(dtype).transpose(1, 2), offs=offsets)
        y = F.grouped_mm(F.silu(gate) * up, w2.to(dtype).transpose(1, 2), offs=offsets)
        # back to token order, weighted and summed, the null routes' rows (which no matmul computed) left out
        return CombineRoutes.apply(y, order, inverse, index, weight)


class _GatherRows(torch.autograd.Function):
    """The tokens in expert order, out = x.index_select(0, src) (src: each sorted route's token),
    whose gradient is each token's routes' rows of the incoming gradient summed: the experts'
    combine without weights (`combine.combine_torch(grad, inverse, index, None)`, one kernel call
    where one is built), the null routes' rows left out (no grouped matmul reads them, so their
    gradient may hold anything). `index_select`'s own backward is an `index_add_`: atomic adds,
    slow in bf16 and not deterministic where k > 1 rows add into one token; this adds each token's
    routes in order."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, src: torch.Tensor, inverse: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse, index)
        return x.index_select(0, src)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        inverse, index = ctx.saved_tensors
        grad = grad.contiguous()
        kernels = combine_kernels(grad, None)
        return (combine_torch if kernels is None else kernels[0])(grad, inverse, index, None), None, None, None
