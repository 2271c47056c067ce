"""Online Lagrangian budget (Sec. budget: the last term of Eq. total and the dual update).

    L += sum_r lambda_r (C_r - C*_r),        lambda_r <- [lambda_r + rho_lambda (EMA(C_r) - C*_r)]_+

C_r in the loss is the differentiable surrogate fraction of the current micro-batch. The dual
update is judged on the *noise-free argmax* decisions (the policy that will run at inference),
accumulated over all micro-batches of an optimizer step, summed across the ranks that hold the
global batch with ONE all-reduce the caller supplies, normalised by the dense cost of the same
tokens, then smoothed by an EMA (momentum `ema_momentum`; the first step initialises the EMA to
the observed value, ours). Everything is float64 so every rank computes bit-identical lambdas.

Tied knob (Appendix A): one multiplier lambda shared by both resources, updated on the summed
violation sum_r (EMA(C_r) - C*_r) and applied to sum_r (C_r - C*_r).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..config import BudgetConfig
from .running_stats import ema_from_first
from .versions import version_key

RESOURCES = ("flops", "mem")


class BudgetController(nn.Module):
    """Projected dual ascent on the realised (FLOPs, memory) fractions."""

    def __init__(self, config: BudgetConfig):
        super().__init__()
        self.config = config
        # Not saved: a resumed run takes its targets from its config (a resume may change them).
        self.register_buffer("targets", torch.tensor([config.flops_target, config.mem_target], dtype=torch.float64),
                             persistent=False)
        n = 1 if config.tied else 2
        self.register_buffer("lambdas", torch.full((n,), config.lambda_init, dtype=torch.float64))
        self.register_buffer("ema", torch.zeros(2, dtype=torch.float64))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        # [mu_flops, mu_mem]: prices of the deployed noise-free decisions (routing/pricing.py),
        # zero during training, set by the end-of-training calibration (training/calibrate.py).
        self.register_buffer("prices", torch.zeros(2, dtype=torch.float64))
        # [cost_flops, cost_mem, dense_flops, dense_mem] summed over the step's micro-batches.
        self.register_buffer("_acc", torch.zeros(4, dtype=torch.float64), persistent=False)

    def multipliers(self) -> torch.Tensor:
        """The multipliers the loss applies: [lambda_I + k_P e]_+ with e = EMA(C) - C* (PI form);
        `lambdas` holds the integral lambda_I. With k_P = 0 this is lambda_I itself. Zero when the
        budget is off (the loss prices nothing, and the logs say so). Every layer of every
        micro-batch reads them and they change only when a buffer they read is written (the step's
        update, a load): computed once per version of those buffers, the same tensor until then."""
        key = (self.config.enabled, self.config.dual_kp, self.config.tied,
               *version_key((self.lambdas, self.ema, self.targets, self.steps)))
        cached = self.__dict__.get("_multipliers_cache")
        if cached is None or cached[0] != key:
            self.__dict__["_multipliers_cache"] = cached = (key, self._multipliers())
        return cached[1]

    def _multipliers(self) -> torch.Tensor:
        if not self.config.enabled:
            return torch.zeros_like(self.lambdas)
        kp = self.config.dual_kp
        if kp == 0.0:
            return self.lambdas
        violation = self.ema - self.targets
        if self.config.tied:
            violation = violation.sum().view(1)
        # Before the first update the EMA holds no observation: lambda_I alone. A select, not a
        # branch on `steps`: every layer reads this, and a branch would read `steps` on the host.
        return torch.where(self.steps == 0, self.lambdas, (self.lambdas + kp * violation).clamp_min(0.0))

    def penalty(self, fractions: torch.Tensor) -> torch.Tensor:
        """sum_r lambda_r (C_r - C*_r) for surrogate fractions (2,) [flops, mem] (Eq. total)."""
        if not self.config.enabled:
            return fractions.sum() * 0.0
        violation = fractions - self.targets.to(fractions.dtype)
        lam = self.multipliers().to(fractions.dtype)
        if self.config.tied:
            return lam[0] * violation.sum()
        return (lam * violation).sum()

    @torch.no_grad()
    def observe(self, cost_sums: torch.Tensor, dense_sums: torch.Tensor) -> None:
        """Accumulate one micro-batch's noise-free hard cost and dense cost sums, each (2,)."""
        self._acc[:2] += cost_sums.to(torch.float64)
        self._acc[2:] += dense_sums.to(torch.float64)

    def discard(self) -> None:
        """Drop this step's accumulated costs (the step was skipped)."""
        self._acc.zero_()

    @torch.no_grad()
    def step(self, all_reduce: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Reduce the step's accumulators across ranks, update EMA and multipliers; returns the
        realised fractions (2,) of this global batch."""
        acc = self._acc.clone()
        self._acc.zero_()
        if all_reduce is not None:
            all_reduce(acc)
        realised = acc[:2] / acc[2:].clamp_min(1e-300)
        self.update(realised)
        return realised

    @torch.no_grad()
    def update(self, realised: torch.Tensor) -> None:
        """One dual-ascent step on the realised fractions (2,) of a global batch."""
        realised = realised.to(torch.float64)
        m = self.config.ema_momentum
        self.ema.copy_(ema_from_first(self.steps, self.ema, realised, m))  # the first step's fractions as they are
        self.steps += 1
        if not self.config.enabled:
            return
        violation = self.ema - self.targets
        if self.config.tied:
            violation = violation.sum().view(1)
        self.lambdas.copy_((self.lambdas + self.config.dual_step * violation).clamp_min(0.0))
