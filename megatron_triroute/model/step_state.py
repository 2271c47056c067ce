"""State shared by every TriRoute layer of one model replica, constant within an optimizer step.

The noise key's `step`, the Gumbel temperature and the budget multipliers change only between
optimizer steps, so reading them from one shared object is safe under interleaved pipeline
schedules and activation recompute. (Per-micro-batch inputs are `RoutingInputs`, see routing_state.py.)

`RouterStatistics` accumulates, per layer, what the trainer logs and the budget is judged on:
option counts per axis, summed soft probabilities, noise-free hard costs and dense costs. The
trainer reduces them over the whole global batch (data-parallel ranks, micro-batches and
pipeline stages) with one all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..config import TriRouteConfig
from ..routing.modes import ATTN_MODES
from ..routing.budget import BudgetController
from ..routing.running_stats import in_backward_pass


class RouterStatistics(nn.Module):
    """Per-layer float64 sums; layout per layer:
    [tokens, attn counts(N_MODES), attn prob sums(N_MODES), expert counts(E'), expert prob sums(E'),
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

    def reset(self) -> None:
        self.sums.zero_()


@dataclass
class RoutingStepState:
    """Shared by all layers of one model replica on one rank."""

    config: TriRouteConfig
    budget: BudgetController
    statistics: RouterStatistics
    step: int = 0
    tau: float = 2.0
    record: bool = field(default=True)
    """Accumulate statistics (off for evaluation passes that must not move the budget)."""
    record_eval: bool = False
    """Accumulate statistics in eval mode too (the trainer measures the realised cost of the
    noise-free policy on held-out data); never feeds the budget."""

    def should_record(self, training: bool) -> bool:
        if in_backward_pass():
            return False
        return self.record and training or self.record_eval and not training
