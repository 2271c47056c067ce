"""Expert gating with a null expert (Sec. axes (B))."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .softmax import softmax

NULL_EXPERT = -1
"""`expert_index` value of the null expert f_0 = 0 (never dispatched, costs nothing): option 0 - 1,
so `top_k_gating` maps options to experts by one subtraction."""


@dataclass
class ExpertRoutes:
    probs: torch.Tensor
    """(..., E') softmax over the options; with a null expert, option 0 is null."""
    index: torch.Tensor
    """(..., k) selected real expert ids in [0, E), or NULL_EXPERT."""
    weight: torch.Tensor
    """(..., k) renormalised gates p_j / sum_{j' in S} p_j' of the selected options."""
    option: torch.Tensor
    """(..., k) selected option ids in [0, E') (option 0 = null when enabled)."""


def option_probs(logits: torch.Tensor) -> torch.Tensor:
    """p = softmax(z^e) over the E' expert options, in float32: what the gates renormalise."""
    return softmax(logits.float())


def top_k_gating(logits: torch.Tensor, top_k: int, null_expert: bool) -> ExpertRoutes:
    """FFN_t = sum_{j in S_t} (p_j / sum_{j' in S_t} p_j') f_j  (Sec. axes, Eq. for FFN_t).

    p = softmax(z^e) over E' = E (+1 null) options; S_t = TopK(p, k); gates renormalised over
    S_t, so gradients reach W_e through the selected gates (Switch/GShard). Null semantics:
    with k = 1 a token whose top option is null gets gate 1 on f_0 = 0, i.e. exactly zero FFN
    output; with k = 2 and S = {null, j} exactly one expert runs and the token gets
    p_bar_j * f_j with p_bar_j = p_j / (p_0 + p_j). Ties break toward the lower option id
    (torch.topk's order is not specified for ties; we sort first to pin it).
    """
    probs = option_probs(logits)
    # A stable descending sort breaks ties toward the lower option id, on every rank alike.
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices
    option = order[..., :top_k]
    weight = renormalised_gates(probs, option)
    if null_expert:
        index = option - 1  # option 0, the null expert, becomes NULL_EXPERT (-1); option j >= 1, expert j - 1
    else:
        index = option
    return ExpertRoutes(probs=probs, index=index, weight=weight.to(logits.dtype), option=option)


def renormalised_gates(probs: torch.Tensor, option: torch.Tensor) -> torch.Tensor:
    """weight = p_S / max(sum p_S, 1e-20), p_S = probs.gather(-1, option) (`top_k_gating`'s gates),
    with its gradient to `probs` from one autograd node (`_RenormalisedGates`) where one is needed."""
    if probs.requires_grad and torch.is_grad_enabled():
        return _RenormalisedGates.apply(probs, option)
    return _gates(probs, option)[0]


def _gates(probs: torch.Tensor, option: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, the clamped sum it divides by): the gates' definition."""
    chosen = probs.gather(-1, option)
    total = chosen.sum(-1, keepdim=True).clamp_min(1e-20)
    return chosen / total, total


class _RenormalisedGates(torch.autograd.Function):
    """`_gates`' weight, and its gradient to probs written out as one expression per row,

        dp_S = (dw - (dw . w)) / sum p_S,   dp = 0 off S,

    (the chain autograd would run through the division, the clamp, the sum and the gather, about
    thirteen ops where this takes six). The clamp's mask is left out: `option` holds the row's
    largest probability of a softmax over E' options, so sum p_S >= 1 / E' and the clamp never acts
    (it guards the forward only). The options of a row are distinct (a sort's first k), so the
    scatter writes each once."""

    @staticmethod
    def forward(ctx, probs: torch.Tensor, option: torch.Tensor) -> torch.Tensor:
        weight, total = _gates(probs, option)
        ctx.save_for_backward(option, weight, total)
        ctx.shape = probs.shape
        return weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        option, weight, total = ctx.saved_tensors
        d_chosen = (grad - (grad * weight).sum(-1, keepdim=True)) / total
        return grad.new_zeros(ctx.shape).scatter_(-1, option, d_chosen), None
