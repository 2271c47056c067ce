"""Incremental side features psi: the same values `routing.side_features.static_side_features`
gives over a whole sequence, computed chunk by chunk from a small per-request state, so decoding
token by token equals one full-sequence forward."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..routing.side_features import TokenTables


@dataclass
class SideState:
    """What psi needs from a request's past."""

    length: int = 0
    """Tokens consumed so far (= the sequence position of the next token)."""
    last_token: int = -1
    doc_start: int = 0
    """Position of the first token of the current document."""
    word_start: int = 0
    """Position of the latest word-initial or document-initial token."""


def advance(tokens: torch.Tensor, lengths: torch.Tensor, states: list[SideState], tables: TokenTables,
            max_doc_position: int) -> torch.Tensor:
    """Side features (B, n, N_STATIC_FEATURES) of the next `lengths[b]` tokens of each request
    (tokens (B, n), right-padded) and the states moved past them."""
    B, n = tokens.shape
    dev = tokens.device
    start = torch.tensor([s.length for s in states], dtype=torch.long, device=dev).view(B, 1)
    pos = start + torch.arange(n, device=dev).view(1, n)  # (B, n) sequence positions
    prev = torch.cat([torch.tensor([s.last_token for s in states], device=dev).view(B, 1), tokens[:, :-1]], 1)
    doc_flag = (pos == 0) | (prev == tables.eod_id)
    none = torch.full_like(pos, -1)
    doc_start = torch.cummax(torch.where(doc_flag, pos, none), 1).values
    doc_start = torch.maximum(doc_start, torch.tensor([s.doc_start for s in states], device=dev).view(B, 1))
    word_flag = tables.word_start[tokens] | doc_flag
    word_start = torch.cummax(torch.where(word_flag, pos, none), 1).values
    word_start = torch.maximum(word_start, torch.tensor([s.word_start for s in states], device=dev).view(B, 1))

    scale = math.log1p(max_doc_position)
    feats = torch.stack([
        torch.log1p((pos - doc_start).float()) / scale,
        torch.log1p((pos - word_start).float()) / scale,
        -tables.log_prob[tokens].float() / math.log(tables.log_prob.numel()),
    ], -1)
    rows = torch.arange(B, device=dev)
    last = (lengths.to(dev) - 1).clamp_min(0)
    ends = torch.stack([tokens[rows, last], doc_start[rows, last], word_start[rows, last]], 1).tolist()
    for s, count, end in zip(states, lengths.tolist(), ends):  # one transfer for the whole batch, then plain integers
        if count == 0:
            continue
        s.length += count
        s.last_token, s.doc_start, s.word_start = end
    return feats
