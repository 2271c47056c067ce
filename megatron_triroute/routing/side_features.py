"""Side features psi_t (Sec. controller): cheap, causal, pinned definitions.

The paper lists relative position, distance since the last whitespace/BOS, a running estimate
of the token's predictive entropy, and the previous layer's decisions. Our definitions:

- document position: t minus the index of the first token of t's document, where a document
  starts at position 0 of the sequence and right after every end-of-document (EOD) token
  (the EOD token itself belongs to the document it closes). Fed as
  log1p(pos) / log1p(max_doc_position).
- word distance: t minus the index of the latest s <= t whose token starts a word (per-token
  table from the tokenizer) or that starts a document; a word-initial token has 0. Fed as
  log1p(dist) / log1p(max_doc_position).
- surprisal: -log p(x_t) from the unigram table saved with the tokenizer (ours: a causal,
  per-token stand-in for the paper's running predictive-entropy estimate), divided by
  log(vocab_size) so a uniform unigram gives 1.
- previous layer's hard decisions (zeros at the first layer): fraction of heads in each
  attention mode (N_MODES), fraction of the k expert slots on real experts (1), one-hot of the
  written bit-width (|bits|), at the slices `MODE_FRACTIONS`, `REAL_EXPERT_FRACTION`,
  `WIDTH_ONE_HOT`. Detached: they are features, not a gradient path.

Every feature of token t reads only tokens <= t.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .modes import N_MODES

N_STATIC_FEATURES = 3
"""Static features per token: document position, word distance, surprisal (not a mode count)."""

MODE_FRACTIONS = slice(0, N_MODES)
"""Previous-layer block: fraction of the heads in each attention mode."""
REAL_EXPERT_FRACTION = N_MODES
"""Previous-layer block: fraction of the k expert slots on real experts."""
WIDTH_ONE_HOT = slice(N_MODES + 1, None)
"""Previous-layer block: one-hot of the written bit-width (|bits| entries)."""


@dataclass
class TokenTables:
    """Per-token tables saved with the tokenizer by data_prep."""

    log_prob: torch.Tensor
    """(V,) float32 natural-log unigram probability of each token id."""
    word_start: torch.Tensor
    """(V,) bool: the token begins a word."""
    eod_id: int

    @classmethod
    def uniform(cls, vocab_size: int, eod_id: int = 0) -> "TokenTables":
        """Tables with no information (uniform unigram, every token starts a word)."""
        return cls(
            log_prob=torch.full((vocab_size,), -math.log(vocab_size)),
            word_start=torch.ones(vocab_size, dtype=torch.bool),
            eod_id=eod_id,
        )


def _last_index_where(flags: torch.Tensor) -> torch.Tensor:
    """For each t, the largest s <= t with flags[s] (0 if none); flags (B, T) bool."""
    T = flags.shape[-1]
    idx = torch.arange(T, device=flags.device).expand_as(flags)
    marked = torch.where(flags, idx, torch.zeros_like(idx))
    return torch.cummax(marked, dim=-1).values


def document_starts(tokens: torch.Tensor, eod_id: int) -> torch.Tensor:
    """(B, T) bool: token t starts a document (t == 0 or token t-1 is EOD)."""
    starts = torch.zeros_like(tokens, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = tokens[:, :-1] == eod_id
    return starts


def document_positions(tokens: torch.Tensor, eod_id: int) -> torch.Tensor:
    """(B, T) position of each token within its own document."""
    T = tokens.shape[-1]
    idx = torch.arange(T, device=tokens.device).expand_as(tokens)
    return idx - _last_index_where(document_starts(tokens, eod_id))


def word_distances(tokens: torch.Tensor, word_start: torch.Tensor, eod_id: int) -> torch.Tensor:
    """(B, T) distance since the last word-initial token or document start."""
    T = tokens.shape[-1]
    idx = torch.arange(T, device=tokens.device).expand_as(tokens)
    flags = word_start.to(tokens.device)[tokens] | document_starts(tokens, eod_id)
    return idx - _last_index_where(flags)


def static_side_features(tokens: torch.Tensor, tables: TokenTables, max_doc_position: int) -> torch.Tensor:
    """(B, T, N_STATIC_FEATURES) float32: [document position, word distance, surprisal], normalised."""
    return normalised_features(document_positions(tokens, tables.eod_id),
                               word_distances(tokens, tables.word_start, tables.eod_id), tokens, tables,
                               max_doc_position)


def normalised_features(doc_position: torch.Tensor, word_distance: torch.Tensor, tokens: torch.Tensor,
                        tables: TokenTables, max_doc_position: int) -> torch.Tensor:
    """(..., N_STATIC_FEATURES) float32 from integer positions and distances of `tokens` (all of one
    shape): log1p(pos) and log1p(dist) over log1p(max_doc_position), and the surprisal over
    log(vocab_size) (module doc). The one normalisation of psi's static block, whoever computed the
    integers (a whole sequence here; a chunk or a decode step, `inference.side_state`)."""
    scale = math.log1p(max_doc_position)
    return torch.stack([
        torch.log1p(doc_position.float()) / scale,
        torch.log1p(word_distance.float()) / scale,
        -tables.log_prob.to(tokens.device)[tokens].float() / math.log(tables.log_prob.numel()),
    ], dim=-1)


def decision_feature_size(num_bits: int) -> int:
    """Width of psi's previous-layer block: mode fractions, real-expert fraction, width one-hot."""
    return N_MODES + 1 + num_bits
