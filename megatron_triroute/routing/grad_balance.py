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
    """Identity on each of a layer's axes' logits; backward: each axis's gradient adds its squared
    L2 norm (float64) to its module's accumulator and is divided by its divisor. Every axis in one
    node: one multi-tensor norm and one accumulation for all of them."""

    @staticmethod
    def forward(ctx, divisors: torch.Tensor, accs: list[torch.Tensor], *zs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.save_for_backward(divisors)
        ctx.accs = accs
        ctx.set_materialize_grads(False)  # an axis whose output takes no gradient adds nothing
        return tuple(z.view_as(z) for z in zs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        (divisors,) = ctx.saved_tensors
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return (None, None, *grads)
        norms = torch._foreach_norm([grads[i] for i in present], 2, dtype=torch.float64)
        torch._foreach_mul_(norms, norms)  # squared norms
        torch._foreach_add_([ctx.accs[i] for i in present], norms)
        divisor = divisors.unbind()
        return (None, None, *(None if g is None else g / divisor[i].to(g.dtype) for i, g in enumerate(grads)))


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
        return GradBalance.balance_all([self], [z], reference)[0]

    @staticmethod
    def balance_all(modules: list["GradBalance"], zs: list[torch.Tensor],
                    reference: torch.Tensor | None = None) -> list[torch.Tensor]:
        """`forward` of each module on its own axis's logits, through one autograd node (the
        modules share `enabled`)."""
        if not modules[0].enabled or not torch.is_grad_enabled():
            return list(zs)
        # rho and the reference are buffers and their functions: nothing tracks a gradient to stop
        rho = torch.stack([m.rho for m in modules]) if len(modules) > 1 else modules[0].rho.view(1)
        divisors = rho if reference is None else rho / reference
        return list(_GradBalanceFn.apply(divisors, [m._acc for m in modules], *zs))

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
