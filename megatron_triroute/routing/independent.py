"""The Independent combo (`router.kind = "independent"`): MoD + MoE + KV-quant, each with its own
router and its own knob, none aware of the others.

    block:   MoD's scalar router and causal predictor (knob: capacity)   -> processed or skipped
    experts: the MoE-only system's router (its own trunk and head over the E real experts, no
             null; knob: top_k)                                            -> top-k for processed tokens
    bits:    every token written at `uniform_bits` (knob: the width; no bit head)

A skipped token reads nothing (`skip` on every head) and runs no expert (index -1 on every
slot). A processed token reads `full` on every head and runs its top-k experts, both scaled by
MoD's router weight g (value 1, see `mod.router_gate`). Nothing is shared between the two
routers, so the expert router's losses never reach the MoD router and vice versa.

Choices that are ours: the expert router is exactly the MoE-only preset's router (a
TriRouteController with only the expert axis), so Independent and MoE-only differ only by the
block skip and the cache width; its balancing losses count every token's top-k choice,
including tokens MoD skips (the router does not know MoD's decision, which is what
"independent" means); its gate gradient comes only from processed tokens.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..config import TriRouteConfig
from .controller import RouterOutput, TriRouteController, _constant_axis
from .gating import NULL_EXPERT, ExpertRoutes
from .mod import MoDBlockRouter, block_attention, require
from .noise import NoiseKey


def expert_only_config(config: TriRouteConfig) -> TriRouteConfig:
    """The config of a TriRoute controller that routes only experts, over the E real experts."""
    moe = copy.deepcopy(config)
    r = moe.router
    r.kind, r.attn_routing, r.bit_routing, r.expert_routing, r.null_expert = "triroute", False, False, True, False
    return moe.validate()


class IndependentController(nn.Module):
    """MoD block router + separate MoE router + uniform KV bits (see module docstring)."""

    def __init__(self, config: TriRouteConfig, layer_number: int):
        super().__init__()
        require(config, "independent", expert_routing=True, null_expert=False, bit_routing=False)
        self.config = config
        self.layer_number = layer_number
        self.n_heads = config.model.n_heads
        self.block = MoDBlockRouter(config)
        self.moe_router = TriRouteController(expert_only_config(config), layer_number)

    def forward(
        self,
        hidden: torch.Tensor,
        side: torch.Tensor,
        noise_key: NoiseKey | None = None,
        tau: float = 1.0,
        prev: RouterOutput | None = None,
    ) -> RouterOutput:
        """hidden: (B, T, d); side: (B, T, F)."""
        B, T = hidden.shape[:2]
        block = self.block(hidden, side)
        attn = block_attention(block.processed, block.gate, self.n_heads)

        moe = self.moe_router(hidden, side, noise_key, tau, prev)
        routes = moe.experts
        processed = block.processed.unsqueeze(-1)  # (B, T, 1), broadcast over the k slots
        experts = ExpertRoutes(
            probs=routes.probs,
            index=torch.where(processed, routes.index, NULL_EXPERT),  # (B, T, k)
            weight=torch.where(processed, routes.weight * block.gate.unsqueeze(-1), routes.weight),
            option=routes.option,
        )
        bits = _constant_axis((B, T), 0, 1, hidden.device)
        # The router's raw logits: balancing losses and the cost model read them as for MoE-only.
        return RouterOutput(attn=attn, bits=bits, experts=experts, expert_logits=moe.expert_logits,
                            extra_loss=block.predictor_loss)
