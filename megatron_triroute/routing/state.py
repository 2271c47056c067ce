"""What a TriRoute layer reads and writes besides the residual stream, as typed values: the
training model (model/layer.py, model/block.py) and the inference engine (inference/model.py)
thread the same state from layer to layer.

    RoutingInputs   functions of the micro-batch, the same for every layer: psi's static
                    features and the global sample index (the routing noise key). Every
                    pipeline stage computes them from the micro-batch it is given.
    RoutingState    what one layer hands the next: its executed decisions (psi's
                    previous-layer block), the layer-group leader's attention choice, and the
                    REINFORCE reward slots.

Inside a pipeline stage these are passed from layer to layer by `model/block.run_layers`; only
between stages is the state packed into rows after the hidden states (`model/stage_wire.py`),
since Megatron's schedules send one tensor. The inference engine computes psi incrementally per
request (inference/side_state.py) and threads `RoutingState` through its layers the same way.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..config import ModelConfig, RouterConfig, TriRouteConfig
from .controller import AxisDecision, RouterOutput, decision_features
from .cost import MicroBatchCosts, micro_batch_costs
from .modes import N_MODES
from .noise import token_words
from .side_features import TokenTables, decision_feature_size, static_side_features


@dataclass(frozen=True)
class RoutingInputs:
    psi: torch.Tensor
    """(B, T, N_STATIC_FEATURES) float32 static side features of the tokens."""
    sample_index: torch.Tensor
    """(B,) int64 global sample index (the noise key)."""

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        """(T,) int64 positions 0 .. T-1 of the micro-batch's tokens in their sequences."""
        return torch.arange(self.psi.shape[1], device=self.psi.device)

    @functools.cached_property
    def noise_words(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`routing.noise.token_words` of (sample_index, positions): every layer's noise key shares them."""
        return token_words(self.sample_index, self.positions)

    def costs(self, model: ModelConfig, router: RouterConfig) -> MicroBatchCosts:
        """`cost.micro_batch_costs` of these tokens, computed once and kept: every layer's cost
        model reads it."""
        kept = self.__dict__.get("_costs")
        if kept is None or kept[0] is not model or kept[1] is not router:
            kept = (model, router, micro_batch_costs(self.positions, self.psi.shape[0], model, router))
            self.__dict__["_costs"] = kept  # frozen dataclass: kept beside the fields, as cached_property does
        return kept[2]

    @classmethod
    def of(cls, tokens: torch.Tensor, sample_index: torch.Tensor, tables: TokenTables,
           max_doc_position: int) -> "RoutingInputs":
        psi = static_side_features(tokens, tables, max_doc_position).float()
        return cls(psi, sample_index.to(device=tokens.device, dtype=torch.int64))


@dataclass(frozen=True)
class RoutingState:
    decisions: torch.Tensor
    """(B, T, F) the previous layer's executed-decision features (zeros before layer 1)."""
    leader: AxisDecision | None = None
    """Layer-group attention only: the group leader's attention decision (y and y_cost
    differentiable, so the leader's straight-through sample gets the followers' gradient)."""
    reward: torch.Tensor | None = None
    """REINFORCE only: (B, T, 2) reward slots, zero in the forward pass; the LM loss's gradient
    reaches every layer's decisions through them (see routing.reinforce)."""

    @classmethod
    def initial(cls, config: TriRouteConfig, batch: int, seq: int, device) -> "RoutingState":
        """The state before the first layer: no decisions yet, zero reward slots."""
        H = config.model.n_heads
        leader = None
        if has_leader(config):
            zeros = torch.zeros(batch, seq, H, N_MODES, device=device)
            leader = AxisDecision(zeros, zeros.clone(), torch.zeros(batch, seq, H, dtype=torch.long, device=device))
        return cls(torch.zeros(batch, seq, decision_feature_size(len(config.router.bits)), device=device), leader,
                   torch.zeros(batch, seq, 2, device=device) if has_reward(config) else None)

    def after(self, out: RouterOutput, config: TriRouteConfig, reward: torch.Tensor | None = None) -> "RoutingState":
        """The state the next layer reads once a layer has decided `out`: its executed decisions,
        the leader's attention choice passed on (a follower reuses the executed choice only, not
        the leader's logits or log-probabilities), and `reward` (None: these reward slots)."""
        B, T = out.attn.y.shape[:2]
        r = config.router
        decisions = decision_features(out, B, T, len(r.bits), r.top_k, self.decisions.device)
        leader = AxisDecision(out.attn.y, out.attn.y_cost, out.attn.hard) if self.leader is not None else None
        return RoutingState(decisions, leader, self.reward if reward is None else reward)

    def leader_output(self) -> RouterOutput | None:
        """The leader's decision in the form a follower's controller reuses (None: no groups)."""
        return None if self.leader is None else RouterOutput(attn=self.leader, bits=self.leader, experts=None)

    # --- as a flat tuple of tensors, for activation recompute (which checkpoints tensors) ------
    def tensors(self) -> tuple[torch.Tensor, ...]:
        out = (self.decisions,)
        if self.leader is not None:
            out += (self.leader.y, self.leader.y_cost, self.leader.hard)
        if self.reward is not None:
            out += (self.reward,)
        return out

    @classmethod
    def from_tensors(cls, tensors: tuple[torch.Tensor, ...], leader: bool, reward: bool) -> "RoutingState":
        decisions, rest = tensors[0], tensors[1:]
        lead = AxisDecision(*rest[:3]) if leader else None
        return cls(decisions, lead, rest[3 if leader else 0] if reward else None)


def has_leader(config: TriRouteConfig) -> bool:
    """Follower layers reuse their group leader's attention choice."""
    return config.router.attn_routing and config.router.attn_granularity == "layer_group"


def has_reward(config: TriRouteConfig) -> bool:
    return config.router.estimator == "reinforce"
