"""Forced routing decisions for decode benchmarks: the real controller runs, its decisions are replaced.

`budget_mix` solves the decision probabilities whose hard cost (`routing.cost.hard_cost`) is the
budget's at a context; `forced_schedule` draws one layer's decisions for a whole run in exact
proportions; `ForcedController` wraps a layer's real controller (run on every call, so its cost is
measured) and returns the scheduled decisions instead of its own; `realised_fractions` and
`measure_mix` read back what the executed decisions cost and were.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_triroute.config import TriRouteConfig
from megatron_triroute.routing.controller import AxisDecision, DecisionBlock, RouterOutput, decision_features
from megatron_triroute.routing.cost import bit_costs, dense_cost, expert_width, hard_cost
from megatron_triroute.routing.gating import NULL_EXPERT, ExpertRoutes
from megatron_triroute.routing.modes import FULL, LOCAL, N_MODES, SKIP, keys_read


# --- the forced decision mix --------------------------------------------------------------------
def budget_mix(config: TriRouteConfig, context: int) -> dict:
    """Decision probabilities whose hard cost is the budget's at query position `context`:
    `bits` (over router.bits) realise `budget.mem_target` of a 16-bit cache (the uniform mix blended
    with the cheapest or dearest width); attention and FFN each realise `budget.flops_target` of
    Dense's (the FFN through the probability `expert_null` that a token's first route is the null
    expert: top-k picks at most one null); where the FFN cannot go that low, attention takes the rest.
    Attention (skip, local, full) per (token, head): skip = local where full alone cannot."""
    m, r, b = config.model, config.router, config.budget
    mix = {"attn": [0.0] * N_MODES, "bits": [1.0], "expert_null": 0.0}
    mix["attn"][FULL] = 1.0
    if r.bit_routing:
        frac = (bit_costs(r, m) / (2 * m.d_kv * 16)).tolist()
        n, uniform = len(frac), sum(frac) / len(frac)
        edge = min(range(n), key=frac.__getitem__) if b.mem_target < uniform else max(range(n), key=frac.__getitem__)
        lam = min(1.0, max(0.0, (b.mem_target - frac[edge]) / (uniform - frac[edge])))
        mix["bits"] = [lam / n + (1 - lam) * (i == edge) for i in range(n)]
    attn_dense, ffn_dense = 2.0 * m.d_model * (context + 1), 3.0 * m.d_model * m.d_ff
    ffn = 1.0
    if r.expert_routing:
        share = expert_width(m, r) / m.d_ff  # one route's share of a dense FFN
        null = min(1.0, max(0.0, r.top_k - b.flops_target / share)) if r.null_expert else 0.0
        mix["expert_null"], ffn = null, (r.top_k - null) * share
    if r.attn_routing:
        a = min(1.0, max(0.0, (b.flops_target * (attn_dense + ffn_dense) - ffn * ffn_dense) / attn_dense))
        local = float(keys_read(torch.tensor(context), r.window)[LOCAL]) / (context + 1)
        full = (a - local / 2) / (1 - local / 2)
        p = [0.0] * N_MODES
        if full >= 0:
            p[FULL], p[LOCAL] = full, (1 - full) / 2
        else:
            p[LOCAL] = min(1.0, a / local)
        p[SKIP] = 1.0 - p[FULL] - p[LOCAL]
        mix["attn"] = p
    return mix


def exact_draw(probs, n: int, g: torch.Generator) -> torch.Tensor:
    """(n,) labels in exact proportions `probs` (largest remainders), in random order."""
    p = torch.tensor(probs, dtype=torch.float64)
    counts = torch.floor(p * n).long()
    rest = n - int(counts.sum())
    counts[torch.argsort(p * n - counts, descending=True)[:rest]] += 1
    labels = torch.repeat_interleave(torch.arange(len(probs)), counts)
    return labels[torch.randperm(n, generator=g)]


def forced_schedule(config: TriRouteConfig, mix: dict, layer: int, calls: int, batch: int,
                    tokens: list[int] | None = None, device: torch.device | str = "cpu") -> list[RouterOutput]:
    """The decisions of `calls` steps of `batch` requests in one layer, in exact proportions over all
    of them; `tokens[c]`: the tokens per request of call c (default 1: decode steps; a prefill takes
    the prompt's length). Drawn on the host, returned on `device` (the model's)."""
    r, m = config.router, config.model
    tokens = [1] * calls if tokens is None else list(tokens)
    if len(tokens) != calls:
        raise ValueError(f"tokens lists {len(tokens)} calls, not {calls}")
    H, N = m.n_heads, sum(tokens) * batch
    g = torch.Generator().manual_seed(1000 + layer)
    block = r.kind in ("mod", "independent")
    processed = exact_draw([1 - r.mod_capacity, r.mod_capacity], N, g).bool() if block else torch.ones(N, dtype=torch.bool)
    if block:
        attn = torch.where(processed, FULL, SKIP).view(N, 1).expand(N, H)
    elif r.attn_routing:
        attn = exact_draw(mix["attn"], N * H, g).view(N, H)
    else:
        attn = torch.full((N, H), FULL)
    n_bits = len(r.bits) if r.bit_routing else 1
    bits = exact_draw(mix["bits"], N, g) if r.bit_routing else torch.zeros(N, dtype=torch.long)
    index = None
    if r.expert_routing:
        k, E = r.top_k, r.num_experts
        first = exact_draw([1.0 / E] * E, N, g)
        index = torch.stack([(first + j) % E for j in range(k)], -1)  # (N, k) distinct experts
        if r.null_expert and r.kind == "triroute":
            index[:, 0] = torch.where(exact_draw([1 - mix["expert_null"], mix["expert_null"]], N, g).bool(),
                                      NULL_EXPERT, index[:, 0])
        if block:
            index = torch.where(processed.view(N, 1), index, NULL_EXPERT)
    attn, bits = attn.to(device), bits.to(device)
    index = None if index is None else index.to(device)
    outs, start = [], 0
    for n in tokens:
        rows = slice(start, start + batch * n)
        start += batch * n
        ya = F.one_hot(attn[rows], N_MODES).float().view(batch, n, H, N_MODES)
        yb = F.one_hot(bits[rows], n_bits).float().view(batch, n, n_bits)
        experts = None
        if index is not None:
            i = index[rows].view(batch, n, -1)
            experts = ExpertRoutes(probs=torch.zeros(batch, n, r.num_experts + int(r.null_expert), device=device),
                                   index=i, weight=torch.full(i.shape, 1.0 / i.shape[-1], device=device),
                                   option=i + 1 if r.null_expert else i)
        out = RouterOutput(attn=AxisDecision(ya, ya, ya.argmax(-1)), bits=AxisDecision(yb, yb, yb.argmax(-1)),
                           experts=experts)
        # psi's block of the forced decisions, drawn with them, as the engine's fused decisions carry theirs
        features = decision_features(out, batch, n, len(r.bits), r.top_k, device)
        out.decision_block = DecisionBlock(features, DecisionBlock.sources_of(out))
        outs.append(out)
    return outs


class ForcedController(nn.Module):
    """The layer's real controller, run on every call (its cost is measured), whose decisions are
    replaced by the next of a schedule drawn before the run; a follower (`prev` given) reuses its
    leader's attention, as the real controller does."""

    def __init__(self, real: nn.Module, config: TriRouteConfig):
        super().__init__()
        self.real, self.config = real, config
        self.schedule: list[RouterOutput] = []
        self._calls = [0]  # advanced in place: a module attribute written each call costs a decode step's time

    @property
    def calls(self) -> int:
        """Scheduled decisions returned so far."""
        return self._calls[0]

    @calls.setter
    def calls(self, n: int) -> None:
        self._calls[0] = n

    def forward(self, hidden, side, noise_key=None, tau=1.0, prev=None, decide=True) -> RouterOutput:
        self.real(hidden, side, noise_key, tau, prev, **({} if decide else {"decide": False}))  # TriRoute's only
        out = self.next_decisions()
        if prev is not None and self.config.router.attn_routing:
            out = RouterOutput(attn=AxisDecision(prev.attn.y, prev.attn.y_cost, prev.attn.hard), bits=out.bits,
                               experts=out.experts)
        return out

    def next_decisions(self) -> RouterOutput:
        """The next scheduled decisions: what `forward` returns after running the real controller, and
        what a decode step with its layers in one call (`inference.fused_step`) gives the layer while
        it runs the real controller itself."""
        calls = self._calls
        if calls[0] >= len(self.schedule):
            raise RuntimeError(f"forced schedule exhausted after {calls[0]} calls; draw one for every step")
        out = self.schedule[calls[0]]
        calls[0] += 1
        return out


def measure_mix(decisions: list[list[RouterOutput]], n_bits: int) -> dict:
    """The realised decision mix of executed decisions (all layers and steps pooled)."""
    outs = [o for step in decisions for o in step]
    modes = torch.cat([o.attn.y.argmax(-1).flatten() for o in outs])
    bits = torch.cat([o.bits.y.argmax(-1).flatten() for o in outs])
    firsts = [o.experts.index[..., 0].flatten() for o in outs if o.experts is not None]
    return {"attn": [float((modes == i).float().mean()) for i in range(N_MODES)],
            "bits": [float((bits == i).float().mean()) for i in range(n_bits)],
            "expert_null": float((torch.cat(firsts) < 0).float().mean()) if firsts else 0.0}


def realised_fractions(steps: list[tuple[torch.Tensor, list[RouterOutput]]], config: TriRouteConfig) -> dict:
    """Budget fractions of executed decisions by the cost model: sum hard_cost / sum dense_cost."""
    m, r = config.model, config.router
    flops = mem = dflops = dmem = 0.0
    for positions, outs in steps:
        positions = positions.to(outs[0].attn.y.device)
        dense = dense_cost(positions, m)
        for o in outs:
            index = None if o.experts is None else o.experts.index
            hc = hard_cost(o.attn.y.argmax(-1), index, o.bits.y.argmax(-1), positions, m, r)
            flops, mem = flops + float(hc.flops.sum()), mem + float(hc.kv_bits.sum())
            dflops += float(dense.flops.expand_as(hc.flops).sum())
            dmem += float(dense.mem.expand_as(hc.kv_bits).sum())
    return {"flops": flops / dflops, "mem": mem / dmem}


def force(model, mix: dict, calls: int, batch: int, tokens: list[int] | None = None) -> None:
    """Give every ForcedController of `model` the decisions of `calls` steps of `batch` requests
    (`tokens`: per call, as `forced_schedule`)."""
    for i, layer in enumerate(model.layers):
        if isinstance(layer.controller, ForcedController):
            layer.controller.schedule = forced_schedule(model.config, mix, i, calls, batch, tokens, model.device)
            layer.controller.calls = 0
