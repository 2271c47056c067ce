"""Cross-axis gradient balancing (Eq. gradbal).

Identity in the forward pass. In the backward pass the gradient reaching a head's logits is
divided by sg(rho), a running EMA of that gradient's L2 norm, kept per (layer, axis) and
initialised to 1:

    rho <- m * rho + (1 - m) * ||dL/dz||_2,   m = 0.99.

Choices that are ours: (a) the paper writes rho <- (1-m) rho + m ||g|| with m = 0.99, which
would weight the newest sample by 0.99; we read m as the conventional EMA momentum. (b) ||g||
is the norm over the whole global batch of one optimizer step: squared norms are accumulated
over micro-batches in backward and summed across ranks at commit, then square-rooted. (c) Only
the model (LM) path goes through this op; the balancing losses and the budget surrogate read
the raw logits, so rho measures exactly the LM gradient the paper names. (d) The divisor is
rho relative to the mean rho of the layer's routed axes (`reference`), i.e. the gradient is
multiplied by mean(rho) / rho_axis. Dividing by rho alone rescales every axis's LM gradient to
unit norm; for a token-mean loss that norm is tiny, so the router's LM gradient would be
amplified by orders of magnitude against the balancing losses and the budget term (on the tiny
recipe the FLOPs budget lost control and training degraded once rho had converged, after ~300
steps). The relative form keeps what the paper wants -- the axes on comparable footing, no change
to the forward pass -- and leaves the overall scale, and so the meaning of alpha, beta, gamma and
lambda, untouched. With one routed axis it is the identity.
"""

from __future__ import annotations

import torch

from .running_stats import RunningStatistic


class _GradBalanceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor, rho: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rho)
        ctx.acc = acc
        return z.view_as(z)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (rho,) = ctx.saved_tensors
        ctx.acc += grad.detach().to(torch.float64).pow(2).sum()
        return grad / rho.to(grad.dtype), None, None


class GradBalance(RunningStatistic):
    """Divide the backward gradient by a detached running norm; forward is the identity."""

    def __init__(self, momentum: float = 0.99, enabled: bool = True):
        super().__init__()
        self.momentum = momentum
        self.enabled = enabled
        self.register_buffer("rho", torch.ones((), dtype=torch.float32))
        self.register_buffer("_acc", torch.zeros(1, dtype=torch.float64), persistent=False)

    def forward(self, z: torch.Tensor, reference: torch.Tensor | None = None) -> torch.Tensor:
        """Identity; backward divides by rho / reference (reference None: by rho itself)."""
        if not self.enabled or not torch.is_grad_enabled():
            return z
        # rho and the reference are buffers and their functions: nothing tracks a gradient to stop
        divisor = self.rho if reference is None else self.rho / reference
        return _GradBalanceFn.apply(z, divisor, self._acc)

    def pending(self) -> torch.Tensor:
        return self._acc

    def batch_key(self) -> object:
        return (GradBalance, self.momentum, self.enabled, self.rho.device)

    @torch.no_grad()
    def commit(self, reduced: torch.Tensor) -> None:
        GradBalance.commit_all([self], [reduced])

    @classmethod
    @torch.no_grad()
    def commit_all(cls, stats: list["GradBalance"], reduced: list[torch.Tensor]) -> None:
        """The EMA update of every module in `stats` (one momentum) as one batched computation."""
        sq_norm = torch.cat(reduced)  # (K,) each module's squared norm over the global batch
        torch._foreach_zero_([g._acc for g in stats])
        if not stats[0].enabled:
            return
        m = stats[0].momentum
        rho = torch.stack([g.rho for g in stats])
        # float64 arithmetic, rounded to fp32 once; no gradient reached this head this step (e.g.
        # the axis unused): rho kept. A select, not a branch: no host read of the norm.
        updated = (m * rho.double() + (1 - m) * sq_norm.clamp_min(0.0).sqrt()).float()
        torch._foreach_copy_([g.rho for g in stats], list(torch.where(sq_norm > 0.0, updated, rho).unbind()))
