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
    chosen = probs.gather(-1, option)
    weight = chosen / chosen.sum(-1, keepdim=True).clamp_min(1e-20)
    if null_expert:
        index = option - 1  # option 0, the null expert, becomes NULL_EXPERT (-1); option j >= 1, expert j - 1
    else:
        index = option
    return ExpertRoutes(probs=probs, index=index, weight=weight.to(logits.dtype), option=option)
