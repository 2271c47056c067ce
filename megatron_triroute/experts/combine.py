"""The experts' combine: each token's k routes, computed in expert order, weighted and summed back
into token order, as one autograd node (`grouped.grouped_swiglu`'s last step).

    out[n] = sum_j weight[n, j] * (y[inverse[n k + j]] if index[n, j] >= 0 else 0)

y (N k, D): the routes' outputs sorted by expert (`routes.sort_routes`: `order` lists the routes
in that order, `inverse` each route's row), the null routes' rows last and computed by no matmul:
they are selected out, never multiplied (they may hold anything). The gradient:

    d y[r] = grad[n] * weight[n, j]    for the route n k + j = order[r] (the null routes' rows too:
                                       no grouped matmul reads their gradient)
    d weight[n, j] = sum_d grad[n] * y[inverse[n k + j]]    (0 for a null route)

The tensor ops below (`combine_torch`: a gather, a select, a product and a sum over the routes;
`combine_backward_torch`: autograd's gradient of them written out) are the definition. Where a
kernel takes the tensors the node runs it instead, one call each way and one pass over the routes'
rows: the C++ kernels `torch.ops.triroute.combine_routes` / `combine_routes_backward` on a CPU
(float32, where built), the Triton kernels of `triroute_kernels.triton_mix` on a GPU (once their first
use has given the definition's values). The forward and d y are the definition's bit for bit (each
product rounded, then the routes added in order); d weight sums each row in another order (equal to
rounding).
"""

from __future__ import annotations

from typing import Callable

import torch
from triroute_kernels import HAS_TRITON, takes_cpu_kernel

from ..routing.kernel_check import checked_once, first_use_probe
from .routes import sort_routes


def combine_torch(y: torch.Tensor, inverse: torch.Tensor, index: torch.Tensor,
                  weight: torch.Tensor | None) -> torch.Tensor:
    """out (N, D) in y's dtype as tensor ops: the definition. weight None: every weight 1, no
    product (the gradient of the tokens' gather into expert order, `grouped._GatherRows`)."""
    N, k = index.shape
    rows = torch.where((index >= 0).view(-1, 1), y.index_select(0, inverse), 0).view(N, k, -1)
    return (rows if weight is None else rows * weight.to(y.dtype).unsqueeze(-1)).sum(1)


def combine_backward_torch(grad: torch.Tensor, y: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor,
                           index: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d y, d weight in weight's dtype) as tensor ops: autograd's gradient of `combine_torch`
    (the sum's expand, the product's two factors, the gather's inverse) written out, except in the
    null routes' rows of d y, which hold grad * weight where autograd's select gives 0 (no grouped
    matmul reads them)."""
    N, k = index.shape
    keep = (index >= 0).unsqueeze(-1)
    rows = torch.where(keep, y.index_select(0, inverse).view(N, k, -1), 0)
    w = weight.to(y.dtype)
    d_rows = grad.unsqueeze(1) * w.unsqueeze(-1)  # (N, k, D)
    d_weight = (grad.unsqueeze(1) * rows).sum(-1).to(weight.dtype)
    return d_rows.view(N * k, -1).index_select(0, order), d_weight


Kernels = tuple[Callable[..., torch.Tensor], Callable[..., tuple[torch.Tensor, torch.Tensor]]]


def combine_kernels(y: torch.Tensor, weight: torch.Tensor | None) -> Kernels | None:
    """(forward, backward) kernels for these tensors, called as the `*_torch` functions are (the
    forward without `order`); None where the tensor ops serve (no kernel built or checked for the
    device and dtype; under torch.compile, which traces the tensor ops)."""
    weight_dtype = torch.float32 if weight is None else weight.dtype
    if takes_cpu_kernel(y) and weight_dtype == torch.float32:
        return torch.ops.triroute.combine_routes, torch.ops.triroute.combine_routes_backward
    if y.is_cuda and HAS_TRITON and not torch.compiler.is_compiling():
        from triroute_kernels import triton_mix

        if triton_mix.combine_fits(y):
            key = ("experts' combine", str(y.device), y.dtype, weight_dtype, y.shape[-1])
            return checked_once(key, lambda: _checked_triton(y.device, y.dtype, weight_dtype, y.shape[-1]))
    return None


def _checked_triton(device: torch.device, dtype: torch.dtype, weight_dtype: torch.dtype, d: int) -> Kernels | None:
    """The Triton kernels once they have given the definition's values on a probe of this layout
    (two routes a token, a null route, a token with only null routes, NaN in the null routes'
    rows): the forward, weighted and not, and d y exactly, d weight within float32 rounding of the
    exact sums. Else None with a warning, and the tensor ops serve."""
    def load() -> Kernels:
        from triroute_kernels.triton_mix import combine_routes_backward_triton, combine_routes_triton

        return combine_routes_triton, combine_routes_backward_triton

    def agrees(kernels: Kernels) -> bool:
        gen = torch.Generator().manual_seed(0)
        index = torch.tensor([[0, 2], [1, -1], [-1, -1], [2, 1], [0, 0]], device=device)
        order, inverse, *_ = sort_routes(index, 3)
        y = torch.randn(10, d, generator=gen).to(device, dtype)
        y[(index < 0).view(-1)[order]] = float("nan")  # the null routes' rows, which no matmul computes
        weight = torch.rand(5, 2, generator=gen).to(device, weight_dtype)
        grad = torch.randn(5, d, generator=gen).to(device, dtype)
        d_y, d_weight = kernels[1](grad, y, order, inverse, index, weight)
        rows = torch.where((index >= 0).view(-1, 1), y.index_select(0, inverse), 0).double()
        exact = (grad.double().repeat_interleave(2, 0) * rows).sum(-1).view(5, 2)
        return (torch.equal(kernels[0](y, inverse, index, weight), combine_torch(y, inverse, index, weight))
                and torch.equal(kernels[0](y, inverse, index, None), combine_torch(y, inverse, index, None))
                and torch.equal(d_y, combine_backward_torch(grad, y, order, inverse, index, weight)[0])
                and torch.allclose(d_weight.double(), exact, rtol=1e-5, atol=1e-5))

    return first_use_probe(device, "the experts' combine", load, agrees)


class CombineRoutes(torch.autograd.Function):
    """`combine_torch(y, inverse, index, weight)` with `combine_backward_torch` as its gradient (to
    y and weight), each one kernel call where `combine_kernels` has kernels for the tensors."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor, index: torch.Tensor,
                weight: torch.Tensor) -> torch.Tensor:
        kernels = combine_kernels(y, weight)
        ctx.save_for_backward(y, order, inverse, index, weight)
        ctx.backward_kernel = kernels[1] if kernels is not None else None
        return combine_torch(y, inverse, index, weight) if kernels is None else kernels[0](y, inverse, index, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        y, order, inverse, index, weight = ctx.saved_tensors
        kernel = ctx.backward_kernel if grad.dtype == y.dtype else None
        d_y, d_weight = (kernel or combine_backward_torch)(grad.contiguous(), y, order, inverse, index, weight)
        return (d_y if ctx.needs_input_grad[0] else None, None, None, None,
                d_weight if ctx.needs_input_grad[4] else None)
