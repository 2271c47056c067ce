"""Straight-through Gumbel-softmax (Sec. relax, Eq. for y~ and y_ST) and its temperature schedule."""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from triroute_kernels import HAS_TRITON, takes_cpu_kernel

from .kernel_check import checked_once, first_use_probe
from .softmax import MANY, softmax


def sample_gumbel(like: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) from the stateful torch generator (tests and single-process use only;
    training passes counter-based noise from `NoiseKey.gumbel`)."""
    u = torch.rand_like(like, dtype=torch.float32).clamp_(1e-9, 1.0 - 1e-9)
    return (-torch.log(-torch.log(u))).to(like.dtype)


def soft_gumbel_sample(logits: torch.Tensor, noise: torch.Tensor, tau: float, dim: int = -1) -> torch.Tensor:
    """The relaxed sample y~_o = softmax((z_o + g_o) / tau) (Sec. relax)."""
    x = (logits + noise) / tau
    return softmax(x) if dim in (-1, x.dim() - 1) else F.softmax(x, dim=dim)


def one_hot(index: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """onehot(index) over n options, (*index.shape, n): `F.one_hot` without its range check, which
    reads the indices' min and max on the host (a device sync per call). Every caller passes
    options it computed itself (argmax, top-k), always in range."""
    return torch.zeros((*index.shape, n), dtype=dtype, device=index.device).scatter_(-1, index.unsqueeze(-1), 1)


def straight_through(y_soft: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """y_ST = sg(onehot(argmax y~) - y~) + y~: one-hot forward, y~'s gradient backward.

    Written as onehot + (y~ - sg(y~)) so the forward value is exactly one-hot in floating point.
    """
    index = y_soft.argmax(dim=dim, keepdim=True)
    y_hard = torch.zeros_like(y_soft).scatter_(dim, index, 1.0)
    return y_hard + (y_soft - y_soft.detach())


class _StraightThroughPair(torch.autograd.Function):
    """Both views of one ST-Gumbel sample, `straight_through(soft_gumbel_sample(., noise, tau))`
    of each, as one node: one relaxed sample and one argmax forward (the views' logits are equal in
    value), and each view's gradient through that sample's softmax backward to its own logits.
    The tensor ops below are the definition; where a kernel takes the tensors (`st_kernels`) the
    forward and the backward are one call each: the same bits on a CPU, the same one-hots and
    values within rounding on a GPU."""

    @staticmethod
    def forward(ctx, z_model, z, noise, tau):
        kernels = st_kernels(z, noise, tau)
        ctx.tau = tau
        ctx.backward_kernel = kernels[1] if kernels is not None else None
        if kernels is not None:
            y, y_cost, y_soft = kernels[0](z, noise, tau)
            ctx.save_for_backward(y_soft)
            return y, y_cost
        y_soft = soft_gumbel_sample(z, noise, tau)
        index = y_soft.argmax(dim=-1, keepdim=True)
        ctx.save_for_backward(y_soft)
        y = torch.zeros_like(y_soft).scatter_(-1, index, 1.0)
        return y, y.clone()  # two outputs of one value: the second view is a copy, not an alias

    @staticmethod
    def backward(ctx, grad_y, grad_y_cost):
        (y_soft,) = ctx.saved_tensors
        if ctx.backward_kernel is not None and grad_y.dtype == grad_y_cost.dtype == y_soft.dtype:
            d_model, d_cost = ctx.backward_kernel(grad_y, grad_y_cost, y_soft, ctx.tau)
            return (d_model if ctx.needs_input_grad[0] else None, d_cost if ctx.needs_input_grad[1] else None,
                    None, None)
        # what autograd runs through y_hard + (y~ - sg(y~)), y~ = softmax((z + g) / tau): the
        # softmax's backward, then the division's
        through = lambda g: torch._softmax_backward_data(g, y_soft, -1, y_soft.dtype) / ctx.tau  # noqa: E731
        return (through(grad_y) if ctx.needs_input_grad[0] else None,
                through(grad_y_cost) if ctx.needs_input_grad[1] else None, None, None)


ST_KERNEL_OPTIONS = 7
"""Options a row may have for the straight-through kernels (a routing axis has 3 or 4): fewer than a
vector of eight floats, where PyTorch's CPU softmax backward adds a row's products in order, as the
kernel does (a full vector's it adds in a tree)."""

StKernels = tuple[Callable[..., tuple[torch.Tensor, ...]], Callable[..., tuple[torch.Tensor, torch.Tensor]]]


def st_kernels(z: torch.Tensor, noise: torch.Tensor, tau) -> StKernels | None:
    """(forward, backward) kernels of the straight-through pair for these tensors, each giving the
    definition's bits: the C++ kernels `torch.ops.triroute.st_gumbel` / `st_gumbel_backward` for
    float32 CPU rows of up to ST_KERNEL_OPTIONS options, where the definition's softmax is
    `few_softmax` too (`softmax.MANY` elements or more), and the temperature a Python number (a
    tensor would be read back to the host); None where the tensor ops serve (and under
    torch.compile)."""
    if not isinstance(tau, (int, float)) or noise.shape != z.shape:  # (a broadcast noise: the tensor ops)
        return None
    if noise.dtype == z.dtype and z.shape[-1] <= ST_KERNEL_OPTIONS and z.numel() >= MANY and takes_cpu_kernel(z):
        return torch.ops.triroute.st_gumbel, torch.ops.triroute.st_gumbel_backward
    if z.is_cuda and HAS_TRITON and not torch.compiler.is_compiling():
        from triroute_kernels import triton_gumbel

        if triton_gumbel.fits(z, noise):
            return checked_once(("straight-through pair", str(z.device)), lambda: _checked_triton(z.device))
    return None


def _checked_triton(device: torch.device) -> StKernels | None:
    """On a GPU, the Triton kernels of `triroute_kernels.triton_gumbel` once they have given the
    definition's one-hots exactly, and its relaxed sample and gradients within float32
    rounding (their softmax is not `F.softmax`'s), on a probe of rows of 3 and 4 options; else None
    with a warning, and the tensor ops serve."""
    def load() -> StKernels:
        from triroute_kernels.triton_gumbel import st_gumbel_backward_triton, st_gumbel_triton

        return st_gumbel_triton, st_gumbel_backward_triton

    def agrees(kernels: StKernels) -> bool:
        gen = torch.Generator().manual_seed(0)
        for n in (3, 4):
            z = (torch.randn(300, n, generator=gen) * 2).to(device)
            noise = -torch.log(-torch.log(torch.rand(300, n, generator=gen))).to(device)
            grads = [torch.randn(300, n, generator=gen).to(device) for _ in range(2)]
            y, y_cost, y_soft = kernels[0](z, noise, 0.7)
            want_soft = soft_gumbel_sample(z, noise, 0.7)
            want_y = torch.zeros_like(want_soft).scatter_(-1, want_soft.argmax(-1, keepdim=True), 1.0)
            want_d = [torch._softmax_backward_data(g, want_soft, -1, want_soft.dtype) / 0.7 for g in grads]
            if not (torch.equal(y, want_y) and torch.equal(y_cost, want_y)
                    and torch.allclose(y_soft, want_soft, rtol=1e-5, atol=1e-6)
                    and all(torch.allclose(a, b, rtol=1e-4, atol=1e-6)
                            for a, b in zip(kernels[1](*grads, y_soft, 0.7), want_d))):
                return False
        return True

    return first_use_probe(device, "the straight-through sample", load, agrees)


def straight_through_pair(z_model: torch.Tensor, z: torch.Tensor, noise: torch.Tensor,
                          tau: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, y_cost): `straight_through(soft_gumbel_sample(z_model, noise, tau))` and the same of z,
    bit for bit, in one autograd node. z_model must equal z in value (a gradient-only transform of
    it, as gradient balancing is): the forward reads z alone."""
    return _StraightThroughPair.apply(z_model, z, noise, tau)


def st_gumbel_softmax(
    logits: torch.Tensor,
    tau: float = 1.0,
    hard: bool = True,
    dim: int = -1,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Straight-through Gumbel-softmax (Sec. relax).

    Forward: onehot(argmax_o (z_o + g_o)) when `hard`, else the soft sample y~. Backward: the
    gradient of y~ = softmax((z + g) / tau). `noise` is the Gumbel draw g; when omitted it comes
    from torch's generator (training passes layout-independent noise from `NoiseKey`).
    """
    if tau <= 0:
        raise ValueError(f"tau={tau!r}: the Gumbel temperature must be positive. Fix: use tau > 0.")
    g = sample_gumbel(logits) if noise is None else noise
    y_soft = soft_gumbel_sample(logits, g, tau, dim)
    return straight_through(y_soft, dim) if hard else y_soft


def temperature_at(step: int, total_steps: int, tau_start: float = 2.0, tau_end: float = 0.5) -> float:
    """Cosine anneal tau_start -> tau_end over `total_steps` (Sec. relax, Appendix B), held after."""
    if total_steps <= 0:
        return tau_end
    progress = min(max(step / total_steps, 0.0), 1.0)
    return tau_end + 0.5 * (tau_start - tau_end) * (1.0 + math.cos(math.pi * progress))
