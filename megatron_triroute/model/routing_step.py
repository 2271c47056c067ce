"""One owner for an optimizer step's routing bookkeeping (begin / end / discard).

A step's routing state has several items, each with its own reduction rule over the global batch:

    begin:   noise-key step and Gumbel temperature; the auxiliary-loss scale (1 / micro-batches)
    end:     gradient-balance EMAs see the global loss's gradient (pending norms x 1/dp^2, since each
             replica back-propagated its own mean), running whitening / balance statistics committed
             over DP, the budget's realised cost and multipliers over DP + PP, router statistics over
             DP + PP (returned for logging, then cleared)
    discard: a skipped step leaves every one of them as it was before the step

The training engine calls these three around its generic forward / backward / reduce / clip /
optimizer sequence and knows nothing else of routing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from ..routing.grad_balance import GradBalance
from ..routing.gumbel import temperature_at
from ..routing.running_stats import commit_running_statistics, discard_running_statistics


class RoutingStep:
    def __init__(self, model):
        self.model = model

    def begin(self, step: int, total_steps: int, micro_batches: int) -> float:
        """Set the step's noise key and temperature; returns the temperature."""
        router = self.model.triroute.router
        tau = temperature_at(step, total_steps, router.tau_start, router.tau_end)
        self.model.set_routing_step(step, tau)
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / micro_batches))
        return tau

    @torch.no_grad()
    def end(self, groups) -> tuple[torch.Tensor, list[float], torch.Tensor]:
        """Commit the step's routing state; returns (realised fractions, multipliers, statistics)."""
        model = self.model
        for module in model.modules():
            if isinstance(module, GradBalance):
                module.pending().mul_(1.0 / groups.dp**2)
        commit_running_statistics([model], lambda t: _reduce(t, groups, pipeline=False))
        realised = model.budget.step(lambda t: _reduce(t, groups, pipeline=True))
        stats = model.router_statistics.sums.clone()
        _reduce(stats, groups, pipeline=True)
        model.router_statistics.reset()
        return realised, model.budget.multipliers().tolist(), stats

    def discard(self) -> None:
        """Drop everything the step accumulated (the step was skipped)."""
        discard_running_statistics([self.model])
        self.model.budget.discard()
        self.model.router_statistics.reset()


def _reduce(t: torch.Tensor, groups, pipeline: bool) -> None:
    """Sum over the data-parallel replicas (and, with `pipeline`, over the pipeline stages)."""
    if groups.dp > 1:
        dist.all_reduce(t, group=groups.dp_group)
    if pipeline and groups.pp > 1:
        dist.all_reduce(t, group=groups.pp_group)
