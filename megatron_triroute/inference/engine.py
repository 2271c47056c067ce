"""Batched serving: requests join and finish independently; prefill and decode run batched.

Each `step()` prefills the requests that joined since the last step (one padded batch) and
decodes one token for every running request (one batch). A request ends after
`max_new_tokens` tokens or at its stop token, and its cache pages go back to the free lists.
Sampling is greedy (temperature 0), or temperature with optional top-p, from a per-request
generator seeded with `seed + request id`, so a request's text does not depend on its batch.

A request may carry its own budget, (FLOPs, KV-memory) targets met by its own prices
(serve_budget.py, from the engine's price curve): a batch then prices each request by its row, and
each request's KV pages keep the widths its prices chose. `realised(rid)` is a request's realised
fractions over its generated tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .audit import CostAudit
from .model import InferenceModel
from .serve_budget import PriceCurve, RequestBudget, row_prices
from .side_state import SideState


@dataclass
class SamplingConfig:
    temperature: float = 0.0
    """0 = greedy."""
    top_p: float = 1.0
    """Nucleus: keep the smallest set of tokens whose probability reaches top_p."""
    seed: int = 0

    def validate(self) -> "SamplingConfig":
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature}: must be >= 0 (0 = greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]; use 1.0 to disable nucleus sampling")
        return self


def sample(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None = None) -> int:
    """One token id from logits (V,)."""
    logits = logits.cpu()  # the per-request generators live on the CPU
    if sampling.temperature == 0.0:
        return int(logits.argmax())
    probs = torch.softmax(logits.double() / sampling.temperature, -1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass of the strictly more likely tokens
        sorted_probs[before >= sampling.top_p] = 0.0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


@dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    stop_token: int | None = None
    generated: list[int] = field(default_factory=list)
    state: SideState = field(default_factory=SideState)
    logits: list[torch.Tensor] = field(default_factory=list)
    """Logits each generated token was sampled from (kept when the engine records them)."""
    prefilled: bool = False
    done: bool = False
    budget: RequestBudget | None = None
    """Its own targets and prices (None: the model's prices)."""
    prompt_cost: list[float] | None = None
    """The audit's per-request totals after its prefill (what its generated tokens are counted from)."""


class InferenceEngine:
    def __init__(self, model: InferenceModel, sampling: SamplingConfig | None = None, page_size: int = 16,
                 record_logits: bool = False, price_curve: PriceCurve | None = None, control: bool = True):
        self.model = model
        self.price_curve = price_curve
        """Realised fractions against prices (serve_budget.py): needed by requests with targets."""
        self.control = control
        self.sampling = (sampling or SamplingConfig()).validate()
        self.cache = model.new_cache(page_size)
        self.audit = CostAudit(model.config.model.n_layers)
        self.record_logits = record_logits
        self.requests: dict[int, Request] = {}
        self._generators: dict[int, torch.Generator] = {}
        self._next_id = 0

    def add(self, prompt: list[int], max_new_tokens: int, stop_token: int | None = None,
            target_flops: float | None = None, target_mem: float | None = None) -> int:
        """A request; `target_flops`/`target_mem`: its own budget (None: the model's own), a
        ValueError when the routing cannot reach it."""
        if not prompt:
            raise ValueError("empty prompt: a request needs at least one token")
        V = self.model.config.model.vocab_size
        if min(prompt) < 0 or max(prompt) >= V:
            raise ValueError(f"prompt token ids must be in [0, {V}); got {min(prompt)}..{max(prompt)}")
        budget = None
        if target_flops is not None or target_mem is not None:
            if self.model.config.router.kind != "triroute":
                raise ValueError("targets need a TriRoute model: its routing is what the prices move")
            if self.price_curve is None:
                raise ValueError("targets need the model's price curve. Fix: give the engine price_curve= "
                                 "(evaluation/calibration.py: curve_loaded)")
            budget = RequestBudget(self.price_curve, (target_flops, target_mem), self.model.host_prices(), self.control)
        rid = self._next_id
        self._next_id += 1
        self.requests[rid] = Request(rid, list(prompt), max_new_tokens, stop_token, budget=budget)
        self.cache.add_request(rid)
        self._generators[rid] = torch.Generator().manual_seed(self.sampling.seed + rid)
        return rid

    @property
    def running(self) -> list[Request]:
        return [r for r in self.requests.values() if not r.done]

    def step(self) -> None:
        """Prefill the new requests, then decode one token for the others (both batched)."""
        fresh = [r for r in self.running if not r.prefilled]
        if fresh:
            n = max(len(r.prompt) for r in fresh)
            tokens = torch.zeros(len(fresh), n, dtype=torch.long)
            for b, r in enumerate(fresh):
                tokens[b, : len(r.prompt)] = torch.tensor(r.prompt)
            self._forward(fresh, tokens, torch.tensor([len(r.prompt) for r in fresh]))
        decoding = [r for r in self.running if r.prefilled and r not in fresh]
        if decoding:
            tokens = torch.tensor([[r.generated[-1]] for r in decoding])
            self._forward(decoding, tokens, torch.ones(len(decoding), dtype=torch.long))

    def _forward(self, batch: list[Request], tokens: torch.Tensor, lengths: torch.Tensor) -> None:
        prices = row_prices([r.budget for r in batch], self.model.host_prices())
        logits, _ = self.model.step(tokens, lengths, [r.state for r in batch], self.cache, [r.rid for r in batch],
                                    self.audit, prices=prices)
        for r, row in zip(batch, logits.cpu()):  # one transfer per step
            if not r.prefilled:
                r.prompt_cost = list(self.audit.requests[r.rid])
            elif r.budget is not None:
                r.budget.update(self.audit.request_totals(r.rid, r.prompt_cost))
            r.prefilled = True
            token = sample(row, self.sampling, self._generators[r.rid])
            r.generated.append(token)
            if self.record_logits:
                r.logits.append(row)
            if len(r.generated) >= r.max_new_tokens or token == r.stop_token:
                self.finish(r.rid)

    def realised(self, rid: int) -> tuple[float, float]:
        """Request `rid`'s realised (FLOPs, memory) fractions over its generated tokens (the ones it
        fed back; (0, 0) before any)."""
        return self.audit.request_fractions(rid, self.requests[rid].prompt_cost)

    def finish(self, rid: int) -> None:
        r = self.requests[rid]
        if not r.done:
            r.done = True
            self.cache.free_request(rid)

    def run(self, prompts: list[list[int]], max_new_tokens: int, stop_token: int | None = None,
            targets: list[tuple[float | None, float | None]] | None = None) -> list[Request]:
        """Serve `prompts` together until every request ends; `targets`: each one's (FLOPs, memory)
        targets (None entries: the model's own)."""
        targets = targets or [(None, None)] * len(prompts)
        ids = [self.add(p, max_new_tokens, stop_token, *t) for p, t in zip(prompts, targets, strict=True)]
        while self.running:
            self.step()
        return [self.requests[i] for i in ids]
