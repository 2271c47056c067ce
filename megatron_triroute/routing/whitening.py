"""Per-axis whitening (Eq. whiten).

Eq. whiten standardises the trunk output with detached running statistics per axis. Applied
literally to the *same* trunk output h, the three axes' statistics would be identical (same
tensor, same tokens), and "per-axis" would mean nothing. Our choice (not the paper's): each
axis whitens its own head's pre-bias projection u^axis = W_axis h_hat, per output unit,

    z^axis = gain * (u^axis - sg(mu^axis)) / sg(sigma^axis + eps) + bias,

so mu/sigma are statistics of three different quantities (attention per head x mode, expert
options, bit options). This keeps the property the paper wants: if one axis collapses, the
scale of another axis's logits across tokens is restored to ~1 by its own statistics, so it
stays discriminative; the learned gain and bias keep full expressiveness (at init mu = 0,
sigma = 1 and the head equals a plain linear head).

Statistics follow `running_stats`: read as they were before this batch, fp32, accumulated in
float64 over the global batch, committed once per optimizer step with EMA momentum m.
"""

from __future__ import annotations

import torch

from .running_stats import RunningStatistic


class RunningWhitening(RunningStatistic):
    """Standardise the last dim with running mean/std from previous optimizer steps."""

    def __init__(self, num_features: int, momentum: float = 0.99, eps: float = 1e-5):
        super().__init__()
        self.momentum = momentum
        self.eps = eps
        self.register_buffer("mean", torch.zeros(num_features, dtype=torch.float32))
        self.register_buffer("var", torch.ones(num_features, dtype=torch.float32))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        # Accumulator: [count, sum(D), sum of squares(D)], float64.
        self.register_buffer("_acc", torch.zeros(1 + 2 * num_features, dtype=torch.float64), persistent=False)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        if self.should_accumulate():
            flat = u.detach().reshape(-1, u.shape[-1]).to(torch.float64)
            d = u.shape[-1]
            self._acc[0] += flat.shape[0]
            self._acc[1 : 1 + d] += flat.sum(0)
            self._acc[1 + d :] += flat.pow(2).sum(0)
        mean = self.mean.detach()
        std = self.var.detach().sqrt()
        return ((u.float() - mean) / (std + self.eps)).to(u.dtype)

    def pending(self) -> torch.Tensor:
        return self._acc

    @torch.no_grad()
    def commit(self, reduced: torch.Tensor) -> None:
        reduced = reduced.clone()
        self._acc.zero_()
        # No tokens this step: every statistic kept. Selects, not a branch: no host read of the count.
        seen = reduced[0] > 0
        count = reduced[0].clamp_min(1.0)
        d = self.mean.numel()
        batch_mean = reduced[1 : 1 + d] / count
        batch_var = (reduced[1 + d :] / count - batch_mean.pow(2)).clamp_min(0.0)
        m = self.momentum
        self.mean.copy_(torch.where(seen, (m * self.mean.double() + (1 - m) * batch_mean).float(), self.mean))
        self.var.copy_(torch.where(seen, (m * self.var.double() + (1 - m) * batch_var).float(), self.var))
        self.steps += seen.to(self.steps.dtype)
