"""Full-sequence scoring on the inference engine.

`score_batch` runs a batch of token sequences through `InferenceModel.step` (noise-free priced
decisions, only the selected computation executes, a fresh paged KV cache) and returns, per
sequence, the log-probability of each target token and whether it was the argmax. The engine's
`CostAudit` passed in counts the executed work, so the realised (FLOPs, KV-memory) fractions of
exactly the scored tokens can be read from it. Uses only the engine's public classes; it adds an
entry point the serving engine (`InferenceEngine`, one sampled token per step) does not have.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..inference.audit import CostAudit
from ..inference.model import InferenceModel
from ..inference.side_state import SideState


@dataclass
class Scored:
    logprobs: torch.Tensor
    """(n,) float64: log p(target[i] | inputs[: i + 1])."""
    greedy: torch.Tensor
    """(n,) bool: target[i] is the argmax of that distribution."""


@torch.no_grad()
def score_batch(model: InferenceModel, inputs: list[list[int]], targets: list[list[int]],
                audit: CostAudit | None = None, page_size: int = 16, decisions: list | None = None) -> list[Scored]:
    """Score each `targets[b]` (the tokens that follow each position of `inputs[b]`, same length).
    With `decisions` (a list), appends this batch's per-layer `RouterOutput`s (batch-first, padded)."""
    if len(inputs) != len(targets):
        raise ValueError(f"{len(inputs)} input sequences but {len(targets)} target sequences")
    if not inputs:
        return []
    lengths = [len(seq) for seq in inputs]
    for b, (seq, tgt) in enumerate(zip(inputs, targets)):
        if not seq or len(seq) != len(tgt):
            raise ValueError(f"sequence {b}: {len(seq)} inputs and {len(tgt)} targets; each needs at least one "
                             "input and exactly one target per input")
    V = model.config.model.vocab_size
    flat = [t for seq in inputs for t in seq] + [t for seq in targets for t in seq]
    if min(flat) < 0 or max(flat) >= V:
        raise ValueError(f"token ids must be in [0, {V}); got {min(flat)}..{max(flat)}")
    B, n = len(inputs), max(lengths)
    tokens = torch.zeros(B, n, dtype=torch.long)
    for b, seq in enumerate(inputs):
        tokens[b, : len(seq)] = torch.tensor(seq)
    cache = model.new_cache(page_size)
    rids = list(range(B))
    for rid in rids:
        cache.add_request(rid)
    try:
        logits, outs = model.step(tokens, torch.tensor(lengths), [SideState() for _ in rids], cache, rids, audit,
                               all_logits=True)
    finally:
        for rid in rids:
            cache.free_request(rid)
    if decisions is not None:
        decisions.append(outs)
    out = []
    for b, tgt in enumerate(targets):
        row = logits[b, : lengths[b]].double()
        target = torch.tensor(tgt)
        logprobs = torch.log_softmax(row, -1).gather(1, target[:, None]).squeeze(1)
        out.append(Scored(logprobs, row.argmax(-1) == target))
    return out
