"""Straight-through Gumbel-softmax (Sec. relax, Eq. for y~ and y_ST) and its temperature schedule."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .softmax import softmax


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
    value), and each view's gradient through that sample's softmax backward to its own logits."""

    @staticmethod
    def forward(ctx, z_model, z, noise, tau):
        y_soft = soft_gumbel_sample(z, noise, tau)
        index = y_soft.argmax(dim=-1, keepdim=True)
        ctx.save_for_backward(y_soft)
        ctx.tau = tau
        y = torch.zeros_like(y_soft).scatter_(-1, index, 1.0)
        return y, y.clone()  # two outputs of one value: the second view is a copy, not an alias

    @staticmethod
    def backward(ctx, grad_y, grad_y_cost):
        (y_soft,) = ctx.saved_tensors
        # what autograd runs through y_hard + (y~ - sg(y~)), y~ = softmax((z + g) / tau): the
        # softmax's backward, then the division's
        through = lambda g: torch._softmax_backward_data(g, y_soft, -1, y_soft.dtype) / ctx.tau  # noqa: E731
        return (through(grad_y) if ctx.needs_input_grad[0] else None,
                through(grad_y_cost) if ctx.needs_input_grad[1] else None, None, None)


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
