"""REINFORCE instead of straight-through Gumbel (the Table 4 estimator ablation).

Forward: the executed attention/bit options are exact samples of softmax(z) (Gumbel-max) with
no straight-through path. Gradient: the score-function estimator

    surrogate = - mean_t sum_{heads} (R_t - b) * log pi(a_t | z_t),

delivered layer by layer through the reward slots that travel with the activations
(`reward_tap`, `reward_slots_loss`), so the pipeline stages need no list of every layer's output.
Reward (ours): R_t = -l_t, the token's own next-token LM loss (detached). Baseline b: an EMA
(momentum 0.9) of the global-batch mean reward, updated once per optimizer step like every
router statistic, so it never depends on the current batch.
"""

from __future__ import annotations

import torch

from .controller import RouterOutput
from .running_stats import RunningStatistic, ema_from_first


class RewardBaseline(RunningStatistic):
    def __init__(self, momentum: float = 0.9):
        super().__init__()
        self.momentum = momentum
        self.register_buffer("value", torch.zeros((), dtype=torch.float64))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("_acc", torch.zeros(2, dtype=torch.float64), persistent=False)

    def observe(self, reward: torch.Tensor) -> None:
        if self.should_accumulate():
            self.accumulate(reward.detach().double().sum(), reward.numel())

    def accumulate(self, total, count) -> None:
        """Add a (sum of rewards, weight) pair; called from backward by the reward tap."""
        self._acc[0] += total
        self._acc[1] += count

    def pending(self) -> torch.Tensor:
        return self._acc

    @torch.no_grad()
    def commit(self, reduced: torch.Tensor) -> None:
        """value <- the global batch's mean reward at the first step with rewards, then its EMA;
        unchanged by a step without rewards. Selects, not branches: no host read (float64, the
        same roundings as the scalar formula)."""
        total, count = reduced.double().unbind()  # may be views of _acc: read before it is zeroed
        mean = total / count
        seen = count > 0
        self.value.copy_(torch.where(seen, ema_from_first(self.steps, self.value, mean, self.momentum), self.value))
        self.steps += seen.long()
        self._acc.zero_()


class _RewardTap(torch.autograd.Function):
    """Identity on a layer's reward slots in the forward pass. In the backward pass the loss's
    gradient on the slots is (w_t * l_t, w_t) -- the token's loss weight times its LM loss, and
    the weight (see `reward_slots_loss`) -- which becomes the score-function gradient
    w_t * (l_t - b) on log pi, with b the loss baseline (-baseline.value)."""

    @staticmethod
    def forward(ctx, slots, log_prob, baseline_value, baseline):
        ctx.save_for_backward(baseline_value)
        ctx.baseline = baseline
        return slots.view_as(slots)

    @staticmethod
    def backward(ctx, grad):
        (value,) = ctx.saved_tensors
        weighted_loss, weight = grad[..., 0], grad[..., 1]
        ctx.baseline.accumulate(-weighted_loss.detach().double().sum(), weight.detach().double().sum())
        grad_log_prob = weighted_loss + value.to(grad.dtype) * weight  # w (l - b), b = -value
        return grad, grad_log_prob, None, None


def reward_tap(slots: torch.Tensor, out: RouterOutput, baseline: "RewardBaseline") -> torch.Tensor:
    """Route the LM loss back to this layer's REINFORCE decisions through the reward slots
    (B, T, 2) that travel with the activations (see routing.state)."""
    log_prob = slots.new_zeros(slots.shape[:2])
    for axis in (out.attn, out.bits):
        if axis.log_prob is not None:
            lp = axis.log_prob
            log_prob = log_prob + (lp.sum(-1) if lp.dim() == 3 else lp)
    return _RewardTap.apply(slots, log_prob, baseline.value.detach(), baseline)


def reward_slots_loss(token_loss: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """token_loss + sg(token_loss) * slot_0 + slot_1: the same value (slots are zero), and the
    gradient on the slots is (weight * loss, weight) per token, whatever weights the loss
    function then applies (mask, token count, micro-batches)."""
    return token_loss + token_loss.detach() * slots[..., 0] + slots[..., 1]
