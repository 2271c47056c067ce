"""Incremental side features psi: the same values `routing.side_features.static_side_features`
gives over a whole sequence, computed chunk by chunk from a small per-request state, so decoding
token by token equals one full-sequence forward."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..routing.side_features import TokenTables, normalised_features


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
    (tokens (B, n), right-padded) and the states moved past them. A decode step (n = 1) takes
    `_advance_one`: the same values bit for bit, in a third of the tensor ops."""
    B, n = tokens.shape
    if n == 1:
        return _advance_one(tokens, lengths, states, tables, max_doc_position)
    return _advance_chunk(tokens, lengths, states, tables, max_doc_position)


def _advance_chunk(tokens: torch.Tensor, lengths: torch.Tensor, states: list[SideState], tables: TokenTables,
                   max_doc_position: int) -> torch.Tensor:
    """`advance` of any chunk, as tensor ops over its positions."""
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

    feats = normalised_features(pos - doc_start, pos - word_start, tokens, tables, max_doc_position)
    rows = torch.arange(B, device=dev)
    last = (lengths.to(dev) - 1).clamp_min(0)
    ends = torch.stack([tokens[rows, last], doc_start[rows, last], word_start[rows, last]], 1).tolist()
    for s, count, end in zip(states, lengths.tolist(), ends):  # one transfer for the whole batch, then plain integers
        if count == 0:
            continue
        s.length += count
        s.last_token, s.doc_start, s.word_start = end
    return feats


def _advance_one(tokens: torch.Tensor, lengths: torch.Tensor, states: list[SideState], tables: TokenTables,
                 max_doc_position: int) -> torch.Tensor:
    """`advance` of one token per request (tokens (B, 1)): the document and word starts, integers,
    on the host from each state (a one-token chunk's cumulative maxima are a `max` with the
    state's), then the features by the same normalisation on the same (B, 1) operands."""
    B = tokens.shape[0]
    flat = tokens.view(B)
    doc, word = [], []
    for s, token, word_flag, count in zip(states, flat.tolist(), tables.word_start[flat].tolist(), lengths.tolist()):
        pos = s.length
        doc_flag = pos == 0 or s.last_token == tables.eod_id
        doc_start = max(pos if doc_flag else -1, s.doc_start)
        word_start = max(pos if word_flag or doc_flag else -1, s.word_start)
        doc.append(pos - doc_start)
        word.append(pos - word_start)
        if count:
            s.length, s.last_token, s.doc_start, s.word_start = pos + 1, token, doc_start, word_start
    distance = torch.tensor([doc, word], dtype=torch.long, device=tokens.device).view(2, B, 1)
    return normalised_features(distance[0], distance[1], tokens, tables, max_doc_position)
