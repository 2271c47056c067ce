"""Routing rows: per-token routing inputs carried along the sequence dim of the hidden states.

Megatron's TransformerBlock calls every layer with a fixed signature, recomputes layers from
their hidden-state input only, and its pipeline schedules send exactly one tensor between
stages. So everything a layer needs besides the residual stream travels *inside* that tensor,
as R extra rows appended after the T token rows of the [s, b, h] hidden states:

    per sequence: [static psi (T x 3) | previous layer's decision features (T x F_dec)
                   | layer-group leader's attention (T x 7H, only in layer_group mode)
                   | global sample index (5 bytes)]  flattened, zero-padded to R * h.

This makes a layer a pure function of its input tensor (exact under activation recompute and
interleaved pipeline schedules), and the previous layer's decisions cross pipeline stages with
the activations. The rows are differentiable (cat/reshape only), so the layer-group leader's
straight-through attention sample receives gradient from the layers that reuse it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ATTN_MODES

_INDEX_BYTES = 5
"""The global sample index travels as 5 bytes (up to 2^40 samples)."""


@dataclass(frozen=True)
class RowLayout:
    seq_len: int
    hidden: int
    n_static: int
    n_decision: int
    n_heads: int
    leader: bool
    """Carry the layer-group leader's attention (y, y_cost, hard) for follower layers."""
    reward: bool = False
    """Carry two REINFORCE reward slots per token (see routing.reinforce.reward_tap)."""

    @property
    def leader_width(self) -> int:
        return (2 * len(ATTN_MODES) + 1) * self.n_heads if self.leader else 0  # y, y_cost, hard

    @property
    def per_token(self) -> int:
        return self.n_static + self.n_decision + self.leader_width + (2 if self.reward else 0)

    @property
    def payload(self) -> int:
        return self.seq_len * self.per_token + _INDEX_BYTES

    @property
    def rows(self) -> int:
        return -(-self.payload // self.hidden)


@dataclass
class RoutingRows:
    """Unpacked routing inputs of one layer, batch-major."""

    static: torch.Tensor
    """(B, T, n_static) psi features of the tokens."""
    decisions: torch.Tensor
    """(B, T, n_decision) previous layer's hard-decision features (zeros before layer 1)."""
    sample_index: torch.Tensor
    """(B,) int64 global sample index (noise key)."""
    leader_y: torch.Tensor | None = None
    """(B, T, H, 3) layer-group leader's executed attention one-hot (differentiable)."""
    leader_y_cost: torch.Tensor | None = None
    leader_hard: torch.Tensor | None = None
    """(B, T, H) int64."""
    reward: torch.Tensor | None = None
    """(B, T, 2) REINFORCE reward slots: zero in the forward pass, the LM loss's gradient in backward."""


def pack(rows: RoutingRows, layout: RowLayout, dtype: torch.dtype) -> torch.Tensor:
    """RoutingRows -> (R, B, h) tensor to append after the token rows."""
    B, T = rows.static.shape[:2]
    parts = [rows.static.to(dtype), rows.decisions.to(dtype)]
    if layout.leader:
        H = layout.n_heads
        parts += [rows.leader_y.reshape(B, T, 3 * H).to(dtype), rows.leader_y_cost.reshape(B, T, 3 * H).to(dtype),
                  rows.leader_hard.reshape(B, T, H).to(dtype)]
    if layout.reward:
        parts.append(rows.reward.to(dtype))
    flat = torch.cat(parts, -1).reshape(B, T * layout.per_token)
    index = rows.sample_index.to(torch.int64)
    # Bytes (0..255) are exact in bf16, fp16 and fp32, so the noise key survives any dtype.
    index_bytes = torch.stack([(index >> (8 * i)) & 0xFF for i in range(_INDEX_BYTES)], -1).to(dtype)
    flat = torch.cat([flat, index_bytes], -1)
    pad = layout.rows * layout.hidden - flat.shape[-1]
    flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(B, layout.rows, layout.hidden).transpose(0, 1)  # (R, B, h)


def unpack(packed: torch.Tensor, layout: RowLayout) -> RoutingRows:
    """(R, B, h) -> RoutingRows (views into `packed`, so gradients flow back)."""
    R, B, h = packed.shape
    flat = packed.transpose(0, 1).reshape(B, R * h)
    T = layout.seq_len
    body = flat[:, : T * layout.per_token].reshape(B, T, layout.per_token)
    index_bytes = flat[:, T * layout.per_token : T * layout.per_token + _INDEX_BYTES].round().to(torch.int64)
    sample_index = sum(index_bytes[:, i] << (8 * i) for i in range(_INDEX_BYTES))
    static = body[..., : layout.n_static]
    decisions = body[..., layout.n_static : layout.n_static + layout.n_decision]
    rows = RoutingRows(static=static, decisions=decisions, sample_index=sample_index)
    if layout.leader:
        H = layout.n_heads
        off = layout.n_static + layout.n_decision
        rows.leader_y = body[..., off : off + 3 * H].reshape(B, T, H, 3)
        rows.leader_y_cost = body[..., off + 3 * H : off + 6 * H].reshape(B, T, H, 3)
        rows.leader_hard = body[..., off + 6 * H : off + 7 * H].round().to(torch.int64)
    if layout.reward:
        rows.reward = body[..., layout.per_token - 2 :]
    return rows


def split(hidden: torch.Tensor, layout: RowLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """[T + R, B, h] -> (token rows [T, B, h], routing rows [R, B, h])."""
    return hidden[: layout.seq_len], hidden[layout.seq_len :]
