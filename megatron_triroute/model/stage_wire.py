"""The tensor one pipeline stage sends the next: hidden states plus the routing state as rows.

Megatron's pipeline schedules send exactly one tensor of shape [s, b, h] between stages, so at
a stage boundary (and only there) the routing state travels as R extra rows after the T token
rows:

    per sequence: [decision features (T x F) | leader attention y, y_cost, hard
                   (T x (2 N_MODES + 1) H, layer groups only) | reward slots (T x 2, REINFORCE
                   only)]  flattened, zero-padded to R * h.

Packing is cat/reshape only, so gradients flow back across the boundary (the followers' gradient
to a leader's straight-through sample, the LM loss's gradient to the reward slots). The values
are exact in the pipeline dtype: features and one-hots are small fractions, `hard` is a small
integer. The static features and the sample index do not travel: every stage derives them from
its micro-batch (`RoutingInputs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import TriRouteConfig
from ..routing.modes import N_MODES
from ..routing.controller import AxisDecision
from ..routing.side_features import decision_feature_size
from ..routing.state import RoutingState, has_leader, has_reward


@dataclass(frozen=True)
class WireLayout:
    seq_len: int
    hidden: int
    n_decision: int
    n_heads: int
    leader: bool
    reward: bool

    @classmethod
    def of(cls, config: TriRouteConfig) -> "WireLayout":
        return cls(config.model.seq_len, config.model.d_model, decision_feature_size(len(config.router.bits)),
                   config.model.n_heads, has_leader(config), has_reward(config))

    @property
    def per_token(self) -> int:
        leader = (2 * N_MODES + 1) * self.n_heads if self.leader else 0  # y, y_cost, hard
        return self.n_decision + leader + (2 if self.reward else 0)

    @property
    def rows(self) -> int:
        return -(-self.seq_len * self.per_token // self.hidden)

    @property
    def seq_length(self) -> int:
        """First dimension of the tensor sent between stages (Megatron's `seq_length`)."""
        return self.seq_len + self.rows


def send(hidden: torch.Tensor, state: RoutingState, layout: WireLayout) -> torch.Tensor:
    """hidden [T, B, h] and the state -> [T + R, B, h]."""
    T, B, h = hidden.shape
    parts = [state.decisions]
    if layout.leader:
        lead, H = state.leader, layout.n_heads
        parts += [lead.y.reshape(B, T, N_MODES * H), lead.y_cost.reshape(B, T, N_MODES * H), lead.hard.reshape(B, T, H)]
    if layout.reward:
        parts.append(state.reward)
    flat = torch.cat([p.to(hidden.dtype) for p in parts], -1).reshape(B, T * layout.per_token)
    flat = torch.nn.functional.pad(flat, (0, layout.rows * h - flat.shape[-1]))
    return torch.cat([hidden, flat.view(B, layout.rows, h).transpose(0, 1)], 0)


def receive(tensor: torch.Tensor, layout: WireLayout) -> tuple[torch.Tensor, RoutingState]:
    """[T + R, B, h] -> hidden [T, B, h] and the state (views, so gradients flow back)."""
    T = layout.seq_len
    hidden, rows = tensor[:T], tensor[T:]
    R, B, h = rows.shape
    body = rows.transpose(0, 1).reshape(B, R * h)[:, : T * layout.per_token].reshape(B, T, layout.per_token)
    decisions, off = body[..., : layout.n_decision], layout.n_decision
    leader = None
    if layout.leader:
        n = N_MODES * layout.n_heads  # one (y or y_cost) block: (H, N_MODES) per token
        H = layout.n_heads
        leader = AxisDecision(body[..., off : off + n].reshape(B, T, H, N_MODES),
                              body[..., off + n : off + 2 * n].reshape(B, T, H, N_MODES),
                              body[..., off + 2 * n : off + 2 * n + H].round().to(torch.int64))
        off += 2 * n + H
    reward = body[..., off : off + 2] if layout.reward else None
    return hidden, RoutingState(decisions, leader, reward)
