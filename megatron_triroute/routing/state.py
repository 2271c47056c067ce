"""What a TriRoute layer reads and writes besides the residual stream, as typed values.

    RoutingInputs   functions of the micro-batch, the same for every layer: psi's static
                    features and the global sample index (the routing noise key). Every
                    pipeline stage computes them from the micro-batch it is given.
    RoutingState    what one layer hands the next: its executed decisions (psi's
                    previous-layer block), the layer-group leader's attention choice, and the
                    REINFORCE reward slots.

Inside a pipeline stage these are passed from layer to layer by `block.run_layers`; only
between stages is the state packed into rows after the hidden states (`stage_wire.py`), since
Megatron's schedules send one tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import TriRouteConfig
from .controller import AxisDecision, RouterOutput
from .side_features import TokenTables, decision_feature_size, static_side_features


@dataclass(frozen=True)
class RoutingInputs:
    psi: torch.Tensor
    """(B, T, 3) float32 static side features of the tokens."""
    sample_index: torch.Tensor
    """(B,) int64 global sample index (the noise key)."""

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
            zeros = torch.zeros(batch, seq, H, 3, device=device)
            leader = AxisDecision(zeros, zeros.clone(), torch.zeros(batch, seq, H, dtype=torch.long, device=device))
        return cls(torch.zeros(batch, seq, decision_feature_size(len(config.router.bits)), device=device), leader,
                   torch.zeros(batch, seq, 2, device=device) if has_reward(config) else None)

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
