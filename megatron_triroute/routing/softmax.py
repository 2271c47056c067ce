"""The softmax over a routing axis's few options.

PyTorch's CPU softmax kernel is slow over a last dimension of a few elements, the router's 3 to 9
options: at (1024, 4, 3) in float32 `F.softmax` takes 226 µs, and `exp(z - max) / sum`, written as
five ops, 51 µs (one thread, a loop over the ops; `exp(z - logsumexp(z))`, three ops, loses up to
1e-5 of a small probability where |z| is large). Its backward kernel has no such cost. So on a CPU,
and up to `FEW` options, the forward is written out, under one autograd node whose backward is
PyTorch's softmax backward; on a GPU, for wider rows, and below `MANY` elements (a decode step's few
rows: (1, 9) takes 1.2 µs in `F.softmax` and 9 µs in the five ops), `F.softmax` is one kernel and is kept.
The five ops are the definition; where the C++ kernels are built they run as one call,
`torch.ops.triroute.few_softmax` (`kernels/csrc/softmax_ops.cpp`: one pass per row).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from triroute_kernels import takes_cpu_kernel

FEW = 16
"""Up to this many options (the last dimension) a CPU tensor takes the written-out forward."""

MANY = 512
"""From this many elements on (rows x options) the written-out forward is the faster one: at (64, 9),
576 elements, 9 µs against `F.softmax`'s 11; at (8, 9) 13 µs against 4."""


def softmax(z: torch.Tensor) -> torch.Tensor:
    """softmax(z) over the last dimension, in z's dtype, with softmax's gradient."""
    if z.device.type != "cpu" or z.shape[-1] > FEW or z.numel() < MANY:
        return F.softmax(z, dim=-1)
    if z.requires_grad and torch.is_grad_enabled():
        return _WrittenOutSoftmax.apply(z)
    return _softmax_forward(z)


def _softmax_forward(z: torch.Tensor) -> torch.Tensor:
    if takes_cpu_kernel(z, (torch.float32, torch.float64)):
        return torch.ops.triroute.few_softmax(z)
    return _softmax_ops(z)


def _softmax_ops(z: torch.Tensor) -> torch.Tensor:
    """The written-out forward as tensor ops: the definition `few_softmax` computes in one call."""
    e = (z - z.amax(-1, keepdim=True)).exp_()
    return e.div_(e.sum(-1, keepdim=True))


class _WrittenOutSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z):
        y = _softmax_forward(z)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return torch._softmax_backward_data(grad, y, -1, y.dtype)
