"""REINFORCE instead of straight-through Gumbel (the Table 4 estimator ablation).

Forward: the executed attention/bit options are exact samples of softmax(z) (Gumbel-max) with
no straight-through path. Gradient: the score-function estimator

    surrogate = - mean_t sum_{heads} (R_t - b) * log pi(a_t | z_t),

Reward (ours): R_t = -l_t, the token's own next-token LM loss (detached). Baseline b: an EMA
(momentum 0.9) of the global-batch mean reward, updated once per optimizer step like every
router statistic, so it never depends on the current batch.
"""

from __future__ import annotations

import torch

from .controller import RouterOutput
from .running_stats import RunningStatistic


class RewardBaseline(RunningStatistic):
    def __init__(self, momentum: float = 0.9):
        super().__init__()
        self.momentum = momentum
        self.register_buffer("value", torch.zeros((), dtype=torch.float64))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("_acc", torch.zeros(2, dtype=torch.float64), persistent=False)

    def observe(self, reward: torch.Tensor) -> None:
        if self.should_accumulate():
            self._acc[0] += reward.detach().double().sum()
            self._acc[1] += reward.numel()

    def pending(self) -> torch.Tensor:
        return self._acc

    @torch.no_grad()
    def commit(self, reduced: torch.Tensor) -> None:
        total, count = reduced.tolist()
        self._acc.zero_()
        if count <= 0:
            return
        mean = total / count
        self.value.fill_(mean if self.steps.item() == 0 else self.momentum * self.value.item() + (1 - self.momentum) * mean)
        self.steps += 1


def reinforce_loss(outputs: list[RouterOutput], token_loss: torch.Tensor, baseline: RewardBaseline) -> torch.Tensor:
    """Score-function surrogate over all layers' attention and bit decisions.

    token_loss: (B, T) per-token LM loss. Layers without REINFORCE log-probs contribute 0.
    """
    reward = -token_loss.detach()
    baseline.observe(reward)
    advantage = (reward - baseline.value.to(reward.dtype)).unsqueeze(-1)  # (B, T, 1)
    total = token_loss.new_zeros(())
    for out in outputs:
        for axis in (out.attn, out.bits):
            if axis.log_prob is None:
                continue
            lp = axis.log_prob if axis.log_prob.dim() == 3 else axis.log_prob.unsqueeze(-1)
            total = total - (advantage * lp).sum(-1).mean()
    return total
