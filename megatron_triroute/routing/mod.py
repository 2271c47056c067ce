"""Mixture-of-Depths block router (Raposo et al. 2024) as a router family (`router.kind = "mod"`).

One scalar score per token decides whether the whole block (attention and FFN) processes it:

    r_t = w^T Norm(x_t) + b
    training:  the top-k tokens of each sequence by r are processed, k = max(1, round(c * T))
    inference: a causal predictor p_t = MLP([sg(Norm(x_t)); psi_t]) decides: processed iff
               sigmoid(p_t) > 0.5  (top-k over the sequence reads future tokens)

A processed token gets `full` attention on every head and its FFN through the one dense expert
(index 0); a skipped token gets `skip` on every head and the null expert, so the residual
stream carries it past the block unchanged. MoD trains its router by scaling the processed
tokens' block outputs by a router weight. We express that weight through the RouterOutput, so
the layer needs no special case: the attention one-hot of a processed token is `full * g_t` and
its expert weight is `g_t`, with

    g_t = 1 + (sigmoid(r_t) - sg(sigmoid(r_t)))        (value exactly 1, gradient of sigmoid(r_t))

The predictor learns top-k membership by binary cross-entropy (the family's `extra_loss`); its
input is detached so it does not shape the residual stream (as in MoD).

Choices that are ours: k rounds half up; ties in r break toward the lower position; the router
norm has no affine weight (w already scales each unit); the predictor also reads the side
features psi (causal by construction); the balancing losses see MoD's expert axis only through
detached logits (MoD has no balancing loss, see `MoDController`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError, RouterConfig, TriRouteConfig
from .modes import FULL, N_MODES, SKIP
from .controller import AxisDecision, RouterOutput, _constant_axis
from .device_values import device_constant
from .gating import NULL_EXPERT, ExpertRoutes
from .noise import NoiseKey
from .side_features import N_STATIC_FEATURES, decision_feature_size
from .softmax import softmax



@dataclass(frozen=True)
class MoDConfig:
    """MoD's own knobs. They are read from `RouterConfig.mod_*` (see `from_router`)."""

    capacity: float = 0.5
    """Fraction c of each sequence's tokens the block processes in training; the MoD system's
    compute knob (k = max(1, round(c * T)) tokens per sequence and block)."""
    predictor_weight: float = 1e-2
    """Weight of the causal predictor's binary cross-entropy in `extra_loss`. Its input is
    detached, so this only sets how fast the predictor learns relative to the model (ours)."""
    predictor_width: int = 128
    """Hidden width of the predictor MLP (ours: the TriRoute trunk width d_r, so both systems
    spend a similar router budget)."""

    @classmethod
    def from_router(cls, router: RouterConfig, path: str = "router") -> "MoDConfig":
        """The knobs as the config sets them, validated."""
        knobs = cls(
            capacity=router.mod_capacity,
            predictor_weight=router.mod_predictor_weight,
            predictor_width=router.mod_predictor_width,
        )
        knobs.validate(path)
        return knobs

    def validate(self, path: str = "router") -> None:
        if not 0.0 < self.capacity <= 1.0:
            raise ConfigError(f"{path}.mod_capacity={self.capacity!r}: the processed fraction must be in (0, 1]. "
                              f"Fix: use e.g. 0.5.")
        if self.predictor_weight < 0:
            raise ConfigError(f"{path}.mod_predictor_weight={self.predictor_weight!r}: must be >= 0. "
                              f"Fix: use 1e-2.")
        if self.predictor_width <= 0:
            raise ConfigError(f"{path}.mod_predictor_width={self.predictor_width!r}: must be positive. "
                              f"Fix: use 128.")


def capacity_tokens(capacity: float, seq_len: int) -> int:
    """k = max(1, round(c * T)) tokens processed per sequence (rounding half up, ours)."""
    return min(seq_len, max(1, math.floor(capacity * seq_len + 0.5)))


def top_k_tokens(scores: torch.Tensor, k: int) -> torch.Tensor:
    """(B, T) bool: the k highest-scoring tokens of each sequence; ties go to the lower position
    (a stable descending sort keeps equal scores in position order)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    return torch.zeros_like(scores, dtype=torch.bool).scatter(-1, order, True)


def router_gate(scores: torch.Tensor) -> torch.Tensor:
    """g = 1 + (sigmoid(r) - sg(sigmoid(r))): forward value exactly 1, gradient d sigmoid(r)."""
    s = torch.sigmoid(scores)
    return 1.0 + (s - s.detach())


@dataclass
class BlockDecision:
    """Which tokens one block processes."""

    processed: torch.Tensor
    """(B, T) bool, executed: top-k of r in training, predictor > 0.5 in eval."""
    gate: torch.Tensor
    """(B, T) router weight g (value 1) that scales a processed token's block output."""
    score: torch.Tensor
    """(B, T) router score r."""
    predictor_logit: torch.Tensor
    """(B, T) logit of the causal predictor."""
    predictor_loss: torch.Tensor | None
    """Weighted BCE of the predictor against top-k membership (training only)."""


class MoDBlockRouter(nn.Module):
    """The scalar MoD router and its causal predictor (shared by `mod` and `independent`)."""

    def __init__(self, config: TriRouteConfig):
        super().__init__()
        model, router = config.model, config.router
        self.knobs = MoDConfig.from_router(router)
        self.norm = nn.RMSNorm(model.d_model, elementwise_affine=False)
        self.score = nn.Linear(model.d_model, 1)
        d_in = model.d_model + N_STATIC_FEATURES + decision_feature_size(len(router.bits))
        width = self.knobs.predictor_width
        self.predictor = nn.Sequential(nn.Linear(d_in, width), nn.GELU(), nn.Linear(width, 1))

    def forward(self, hidden: torch.Tensor, side: torch.Tensor) -> BlockDecision:
        """hidden: (B, T, d); side: (B, T, F) psi."""
        x = self.norm(hidden.float())  # (B, T, d)
        score = self.score(x).squeeze(-1)  # (B, T)
        pred = self.predictor(torch.cat([x.detach(), side.float()], -1)).squeeze(-1)  # (B, T)
        if self.training:
            processed = top_k_tokens(score.detach(), capacity_tokens(self.knobs.capacity, score.shape[1]))
            bce = F.binary_cross_entropy_with_logits(pred, processed.float())
            loss = self.knobs.predictor_weight * bce
        else:
            processed = torch.sigmoid(pred) > 0.5  # reads token t only: causal
            loss = None
        return BlockDecision(processed, router_gate(score), score, pred, loss)


def block_attention(processed: torch.Tensor, gate: torch.Tensor, n_heads: int) -> AxisDecision:
    """Whole-block attention decision: `full * g` on every head of a processed token, `skip` on
    every head of a skipped one. No learned categorical head (logits=None)."""
    B, T = processed.shape
    full = device_constant([float(m == FULL) for m in range(N_MODES)], gate.dtype, gate.device)  # (N_MODES,)
    skip = device_constant([float(m == SKIP) for m in range(N_MODES)], gate.dtype, gate.device)
    y = torch.where(processed[..., None], gate[..., None] * full, skip)  # (B, T, N_MODES)
    y = y.unsqueeze(2).expand(B, T, n_heads, N_MODES)  # (B, T, H, N_MODES)
    hard = torch.where(processed, FULL, SKIP).unsqueeze(2).expand(B, T, n_heads)  # (B, T, H)
    return AxisDecision(y=y, y_cost=y, hard=hard)


def require(config: TriRouteConfig, family: str, **expected) -> None:
    """Raise a ConfigError naming the first router field that differs from what `family` needs."""
    for name, value in expected.items():
        actual = getattr(config.router, name)
        if actual != value:
            raise ConfigError(
                f"router.{name}={actual!r}: router.kind={family!r} needs {name}={value!r} "
                f"(when instantiating the {family} controller). "
                f"Fix: build the config with megatron_triroute.systems.system_config({family!r}, base)."
            )


class MoDController(nn.Module):
    """Mixture-of-Depths: one scalar router per layer gates the whole block.

    Needs E = 1 dense expert plus the null expert, top-1, no bit head (the preset
    `systems.system_config("mod", base)` sets these and the expert width to d_ff). The expert
    axis carries detached logits [0, s] (softmax = [1 - sigmoid(s), sigmoid(s)], s = r in
    training, the predictor logit in eval) so the cost model can read it while the balancing
    losses put no gradient on it: MoD's router learns only through g and capacity fixes its load.
    """

    def __init__(self, config: TriRouteConfig, layer_number: int):
        super().__init__()
        require(config, "mod", expert_routing=True, num_experts=1, top_k=1, null_expert=True, bit_routing=False)
        self.config = config
        self.layer_number = layer_number
        self.n_heads = config.model.n_heads
        self.block = MoDBlockRouter(config)

    def forward(
        self,
        hidden: torch.Tensor,
        side: torch.Tensor,
        noise_key: NoiseKey | None = None,
        tau: float = 1.0,
        prev: RouterOutput | None = None,
    ) -> RouterOutput:
        """hidden: (B, T, d); side: (B, T, F). MoD draws no noise and ignores tau and prev."""
        B, T = hidden.shape[:2]
        block = self.block(hidden, side)
        attn = block_attention(block.processed, block.gate, self.n_heads)

        s = block.score if self.training else block.predictor_logit
        expert_logits = torch.stack([torch.zeros_like(s), s], -1).detach()  # (B, T, 2): [null, dense]
        option = block.processed.long().unsqueeze(-1)  # (B, T, 1): 1 = the dense expert, 0 = null
        experts = ExpertRoutes(
            probs=softmax(expert_logits),
            index=torch.where(option == 1, 0, NULL_EXPERT),
            weight=torch.where(option == 1, block.gate.unsqueeze(-1), torch.ones_like(block.gate).unsqueeze(-1)),
            option=option,
        )
        bits = _constant_axis((B, T), 0, 1, hidden.device)
        return RouterOutput(attn=attn, bits=bits, experts=experts, expert_logits=expert_logits,
                            extra_loss=block.predictor_loss)
