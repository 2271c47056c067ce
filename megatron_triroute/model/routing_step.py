"""The routing step: the one owner of what a model replica's routing keeps between micro-batches.

    RouterStatistics  per-layer float64 sums every layer records into: what the trainer logs and
                      the realised cost is measured on
    RoutingStepState  what every layer reads, constant within an optimizer step (so safe under
                      interleaved pipeline schedules and activation recompute): the noise key's
                      step, the Gumbel temperature, the budget, the statistics, the prices an
                      eval-mode forward takes its decisions with
    RoutingStep       the state's only writer:

    begin:       noise-key step and Gumbel temperature; the auxiliary-loss scale (1 / micro-batches)
    end:         gradient-balance EMAs see the global loss's gradient (pending norms x 1/dp^2, since
                 each replica back-propagated its own mean), running whitening / balance statistics
                 committed over DP, the budget's realised cost and multipliers over DP + PP, router
                 statistics over DP + PP (returned for logging, then cleared)
    discard:     a skipped step leaves every one of them as it was before the step
    evaluation:  a pass of the noise-free policy at given prices (eval mode): the step's statistics
                 set aside and restored after, the pass's own read with `statistics`; the budget
                 never sees it

The training engine calls these around its generic forward / backward / reduce / clip / optimizer
sequence and its evaluation pass, and knows nothing else of routing. Per-micro-batch values
(`RoutingInputs`, `RoutingState`) are passed from layer to layer instead (routing/state.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..config import TriRouteConfig
from ..routing.budget import BudgetController
from ..routing.grad_balance import GradBalance
from ..routing.gumbel import temperature_at
from ..routing.modes import ATTN_MODES
from ..routing.running_stats import (
    commit_running_statistics,
    discard_running_statistics,
    in_backward_pass,
    running_statistics,
)


class RouterStatistics(nn.Module):
    """Per-layer float64 sums; layout per layer:
    [tokens, attn counts(3), attn prob sums(3), expert counts(E'), expert prob sums(E'),
     bit counts(|B|), bit prob sums(|B|), hard flops, hard mem, dense flops, dense mem]."""

    def __init__(self, config: TriRouteConfig):
        super().__init__()
        r = config.router
        self.n_attn = len(ATTN_MODES)
        self.n_exp = r.num_expert_options if r.expert_routing else 0
        self.n_bits = len(r.bits) if r.bit_routing else 1
        self.width = 1 + 2 * (self.n_attn + self.n_exp + self.n_bits) + 4
        self.register_buffer("sums", torch.zeros(config.model.n_layers, self.width, dtype=torch.float64),
                             persistent=False)

    def slices(self) -> dict[str, slice]:
        out, i = {"tokens": slice(0, 1)}, 1
        for name, n in (("attn", self.n_attn), ("experts", self.n_exp), ("bits", self.n_bits)):
            out[f"{name}/fraction"] = slice(i, i + n)
            out[f"{name}/prob"] = slice(i + n, i + 2 * n)
            i += 2 * n
        out["cost"] = slice(i, i + 2)
        out["dense"] = slice(i + 2, i + 4)
        return out

    def realised(self, sums: torch.Tensor) -> list[float]:
        """Noise-free (FLOPs, memory) cost over dense cost, all layers, from per-layer `sums`."""
        sl = self.slices()
        cost, dense = sums[:, sl["cost"]].sum(0), sums[:, sl["dense"]].sum(0)
        return (cost / dense.clamp_min(1e-300)).tolist()

    def reset(self) -> None:
        self.sums.zero_()


@dataclass
class RoutingStepState:
    """Shared by all layers of one model replica on one rank; written by `RoutingStep` only."""

    config: TriRouteConfig
    budget: BudgetController
    statistics: RouterStatistics
    step: int = 0
    tau: float = 2.0
    prices: torch.Tensor | None = None
    """(2,) float64 [mu_flops, mu_mem] the eval-mode forward prices its decisions with
    (routing/pricing.py); None: the plain argmax. Set for an evaluation pass only: training never
    prices."""
    record_eval: bool = False
    """Accumulate statistics in eval mode too (an evaluation pass measures the realised cost of the
    noise-free policy); never feeds the budget."""

    def should_record(self, training: bool) -> bool:
        if in_backward_pass():
            return False
        return training or self.record_eval


class RoutingStep:
    def __init__(self, model, config: TriRouteConfig, budget: BudgetController, statistics: RouterStatistics):
        self.model = model
        self.state = RoutingStepState(config, budget, statistics)
        self._statistics_modules: list | None = None

    def running_statistics(self) -> list:
        """The model's running statistics (`routing.running_stats.running_statistics`), found on the
        first call: a model gains no module after it is built, and the walk costs host time every
        step."""
        if self._statistics_modules is None:
            self._statistics_modules = running_statistics([self.model])
        return self._statistics_modules

    def set_step(self, step: int, tau: float) -> None:
        """The noise key's step and the Gumbel temperature every layer reads."""
        self.state.step, self.state.tau = step, tau

    def begin(self, step: int, total_steps: int, micro_batches: int) -> float:
        """Set the step's noise key and temperature; returns the temperature."""
        router = self.state.config.router
        tau = temperature_at(step, total_steps, router.tau_start, router.tau_end)
        self.set_step(step, tau)
        # Imported here: RouterStatistics' layout (this module) serves the planner and dry runs,
        # which must not pay Megatron-Core's import (2 s).
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / micro_batches))
        return tau

    @torch.no_grad()
    def end(self, groups) -> tuple[torch.Tensor, list[float], torch.Tensor]:
        """Commit the step's routing state; returns (realised fractions, multipliers, statistics)."""
        budget, stats = self.state.budget, self.running_statistics()
        balances = [m.pending() for m in stats if isinstance(m, GradBalance)]
        if balances and groups.dp > 1:
            torch._foreach_mul_(balances, 1.0 / groups.dp**2)
        commit_running_statistics(stats, lambda t: _reduce(t, groups, pipeline=False))
        realised = budget.step(lambda t: _reduce(t, groups, pipeline=True))
        stats = self.statistics(groups)
        self.state.statistics.reset()
        return realised, budget.multipliers().tolist(), stats

    def discard(self) -> None:
        """Drop everything the step accumulated (the step was skipped)."""
        discard_running_statistics(self.running_statistics())
        self.state.budget.discard()
        self.state.statistics.reset()

    @torch.no_grad()
    def statistics(self, groups) -> torch.Tensor:
        """The router statistics recorded so far, summed over the global batch (DP replicas and
        pipeline stages: every layer's row is whole on every rank). A collective on every rank."""
        stats = self.state.statistics.sums.clone()
        _reduce(stats, groups, pipeline=True)
        return stats

    @contextmanager
    def evaluation(self, prices: Sequence[float] | torch.Tensor | None = None) -> Iterator[None]:
        """An evaluation pass: the model in eval mode (noise-free decisions, priced by `prices`
        (mu_flops, mu_mem); None: the plain argmax), recording statistics apart from the step's.
        Read the pass's with `statistics` inside the block. On exit the step's statistics, the
        unpriced forward and train mode are back, whatever happened inside."""
        state, stats = self.state, self.state.statistics
        saved = stats.sums.clone()
        stats.reset()
        state.record_eval = True
        # On the host: every layer reads them as Python floats (routing/pricing.py).
        state.prices = None if prices is None else torch.as_tensor(prices, dtype=torch.float64).detach().cpu().clone()
        self.model.eval()
        try:
            yield
        finally:
            self.model.train()
            state.record_eval, state.prices = False, None
            stats.sums.copy_(saved)


def _reduce(t: torch.Tensor, groups, pipeline: bool) -> None:
    """Sum over the data-parallel replicas (and, with `pipeline`, over the pipeline stages)."""
    if groups.dp > 1:
        dist.all_reduce(t, group=groups.dp_group)
    if pipeline and groups.pp > 1:
        dist.all_reduce(t, group=groups.pp_group)
