"""Priced noise-free decisions: the deployed policy as the argmax of the Lagrangian (ours).

Why. The dual variables of `budget.BudgetController` are judged on the noise-free argmax policy
while the gradient acts on the sampled relaxed policy. When most tokens hold similar logit
margins between two options (e.g. 4 and 8 KV bits), the argmax policy's cost is a near step
function of the multipliers and the primal-dual loop settles into a limit cycle around the
target: the realised cost swings from step to step, and the cost of the checkpoint a user stops
at depends on which side the last step landed. Damping the dual (the PI form, `dual_kp`) narrows
the swing but cannot remove it, and the primal-dual method only promises the target on average
over iterates, not at the last one.

What. At the end of training the deployed decisions become the argmax of the per-token
Lagrangian with calibrated prices mu = (mu_flops, mu_mem):

    attention mode m of a head:  argmax_m  z_m - mu_flops * c_flops(m, t)
    KV bit-width b:              argmax_b  z_b - mu_mem   * c_mem(b)
    experts:                     TopK_j    z_j - mu_flops * c_flops(j)       (c(null) = 0)

where c_r(o, t) is the option's cost as a fraction of the dense cost of the same token and
layer (Appendix A's normalisation, per token). The cost of each token's decision is
non-increasing in its price, so one bisection per resource on calibration batches finds the
price at which the realised fraction meets the target (see training/calibrate.py). An active
constraint (lambda_r > 0 at the end) is met with equality, so mu_r may be negative (the policy
was under budget: spend what the budget allows); an inactive one only ever gets mu_r >= 0.
Gate weights stay the unpriced renormalised probabilities of the selected experts. Prices of
zero leave every decision as the plain argmax; training always runs with zero prices.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..config import ModelConfig, RouterConfig
from .controller import AxisDecision, RouterOutput, decode_decisions
from .cost import bit_costs, dense_cost, expert_width
from .modes import keys_read
from .gating import option_probs, top_k_gating
from .gumbel import one_hot


def option_cost_fractions(positions: torch.Tensor, model: ModelConfig, router: RouterConfig, attn_heads: int):
    """Per-token option costs as fractions of the dense cost of the token's layer.

    Returns (attn (..., N_MODES): one attention head's share per mode, expert (...): one real
    expert, bits (|bits|,)). positions: (...) 0-based, e.g. (T,) or (B, T). `attn_heads` heads share
    the query heads evenly.
    """
    dense = dense_cost(positions, model)
    heads_per_decision = model.n_heads / attn_heads
    attn = heads_per_decision * 2.0 * model.d_head * keys_read(positions, router.window) / dense.flops.unsqueeze(-1)
    expert = 3.0 * model.d_model * expert_width(model, router) / dense.flops
    bits = bit_costs(router, model, positions.device) / (2.0 * model.d_kv * 16)
    return attn, expert, bits


def _priced_axis(d: AxisDecision, shift: torch.Tensor, n_heads: int) -> AxisDecision:
    hard = (d.logits.double() - shift).argmax(-1)  # (B, T, [H_a])
    y = one_hot(hard, d.logits.shape[-1], d.logits.dtype)
    if hard.dim() == 3 and hard.shape[2] != n_heads:  # token-granular attention: one mode for all heads
        B, T = hard.shape[:2]
        hard = hard.expand(B, T, n_heads)
        y = y.expand(B, T, n_heads, y.shape[-1])
    return AxisDecision(y, y, hard, logits=d.logits)


def price_decisions(out: RouterOutput, prices, positions: torch.Tensor,
                    model: ModelConfig, router: RouterConfig) -> RouterOutput:
    """Noise-free decisions of `out` re-taken as the argmax of the priced logits (module doc).

    prices: (2,) [mu_flops, mu_mem] for every token (a tensor or a pair of floats); or a (B, 2)
    tensor, one row per request (row b of `out`), broadcast over its tokens, positions then (T,)
    shared or (B, T) each request's own; or the `PriceShifts` of such rows, computed once for a
    step's layers (`price_shifts`). The per-row path reads nothing back to the host (a serving
    step stays free of syncs) and prices every axis, zero rows included. Axes without logits
    (fixed, or a layer-group follower that reuses its leader's decision) are left as they are.
    Only for the noise-free (eval) path.
    """
    if isinstance(prices, PriceShifts):
        return _price_rows(out, prices, model, router)
    if torch.is_tensor(prices) and prices.dim() == 2:
        attn_heads = out.attn.logits.shape[2] if out.attn.logits is not None else 1
        return _price_rows(out, price_shifts(prices, positions, model, router, attn_heads), model, router)
    mu_flops, mu_mem = (float(p) for p in prices)
    if mu_flops == 0.0 and mu_mem == 0.0:
        return out
    T = positions.shape[-1]
    attn, bits, experts = out.attn, out.bits, out.experts
    attn_heads = attn.logits.shape[2] if attn.logits is not None else 1
    c_attn, c_expert, c_bits = option_cost_fractions(positions.view(-1)[:T], model, router, attn_heads)
    if attn.logits is not None and mu_flops != 0.0:
        attn = _priced_axis(attn, mu_flops * c_attn.view(1, T, 1, -1), model.n_heads)
    if bits.logits is not None and mu_mem != 0.0:
        bits = _priced_axis(bits, mu_mem * c_bits, model.n_heads)
    if out.expert_logits is not None and mu_flops != 0.0:
        experts = _priced_experts(out, _option_shifts((mu_flops * c_expert).view(1, T, 1), router), router)
    return dataclasses.replace(out, attn=attn, bits=bits, experts=experts)


@dataclass
class PriceShifts:
    """Per-row prices times option costs, what the priced argmax subtracts from the logits."""

    attn: torch.Tensor
    """(B, T, 1, N_MODES) mu_flops c_attn: one attention decision's modes."""
    expert: torch.Tensor
    """(B, T, E') mu_flops c_expert for each expert option, 0 for the null expert (`_option_shifts`)."""
    bits: torch.Tensor
    """(B, 1, |bits|) mu_mem c_bits."""

    def to(self, device) -> "PriceShifts":
        return PriceShifts(self.attn.to(device), self.expert.to(device), self.bits.to(device))


def price_shifts(prices: torch.Tensor, positions: torch.Tensor, model: ModelConfig, router: RouterConfig,
                 attn_heads: int) -> PriceShifts:
    """The shifts of (B, 2) per-row prices at positions (T,) shared or (B, T); `attn_heads`: the
    attention decisions per token (the controller's H_a)."""
    B = prices.shape[0]
    T = positions.shape[-1]
    pos = positions.expand(B, T) if positions.dim() == 2 else positions.view(1, T).expand(B, T)
    c_attn, c_expert, c_bits = option_cost_fractions(pos, model, router, attn_heads)  # (B, T, M), (B, T), (|b|,)
    mu = prices.to(torch.float64)
    mu_flops, mu_mem = mu[:, 0].view(B, 1), mu[:, 1].view(B, 1)
    return PriceShifts((mu_flops.unsqueeze(-1) * c_attn).unsqueeze(2),
                       _option_shifts((mu_flops * c_expert).unsqueeze(-1), router), mu_mem.unsqueeze(-1) * c_bits)


def _option_shifts(shift: torch.Tensor, router: RouterConfig) -> torch.Tensor:
    """One real expert's price (..., 1) as the price of each expert option (..., E'): the null
    expert (option 0, with `router.null_expert`) costs nothing."""
    shift = shift.expand(*shift.shape[:-1], router.num_expert_options).clone()
    if router.null_expert:
        shift[..., 0] = 0.0
    return shift


def _priced_experts(out: RouterOutput, shift: torch.Tensor, router: RouterConfig):
    """The experts re-chosen as TopK of the logits less `shift` ((B|1, T, E'), `_option_shifts`),
    with the unpriced renormalised probabilities of the selected set as gates (the softmax of the
    logits, `gating.option_probs`, when `out` carries no unpriced routes)."""
    z = out.expert_logits
    probs = out.experts.probs if out.experts is not None else option_probs(z)
    routes = top_k_gating(z.double() - shift, router.top_k, router.null_expert)
    chosen = probs.gather(-1, routes.option)  # unpriced probabilities of the selected set
    weight = (chosen / chosen.sum(-1, keepdim=True).clamp_min(1e-20)).to(z.dtype)
    return dataclasses.replace(routes, probs=probs, weight=weight)


def _price_rows(out: RouterOutput, shifts: PriceShifts, model: ModelConfig, router: RouterConfig) -> RouterOutput:
    """price_decisions with one (mu_flops, mu_mem) row per request, as its shifts."""
    attn, bits, experts = out.attn, out.bits, out.experts
    n_heads = model.n_heads
    if attn.logits is not None and bits.logits is not None and out.expert_logits is not None and out.extra_loss is None:
        fused = decode_decisions(attn.logits, out.expert_logits, bits.logits, n_heads, router, shifts)
        if fused is not None:
            return fused
    if attn.logits is not None:
        attn = _priced_axis(attn, shifts.attn, n_heads)
    if bits.logits is not None:
        bits = _priced_axis(bits, shifts.bits, n_heads)
    if out.expert_logits is not None:
        experts = _priced_experts(out, shifts.expert, router)
    return dataclasses.replace(out, attn=attn, bits=bits, experts=experts)
