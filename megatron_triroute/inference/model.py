"""The pure-PyTorch hard-decision TriRoute model (the engine's network and the export's modeling code).

    for each layer:  out = priced noise-free controller(x, [psi; state.decisions], state's leader)
                     x = x + RoutedAttn(Norm(x); out.attn modes, out.bits width)   (paged cache)
                     x = x + Experts(Norm(x); out.experts routes)  (or the dense FFN)
                     state = state.after(out)     (routing/state.py: the training layers' own RoutingState)
    logits = W_out Norm(x)

The controller is the routing core's own module (`routing.factory.build_controller`), in eval
mode, and for `router.kind == "triroute"` its decisions are re-taken as the priced argmax
(`routing.pricing.price_decisions` with the checkpoint's `budget.prices`), exactly as the
Megatron layer does in an evaluation pass given those prices. Imports only torch and the project's pure-torch routing code.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ..config import TriRouteConfig
from ..routing.controller import RouterOutput
from ..routing.cost import dense_cost, expert_width
from ..routing.factory import build_controller
from ..routing.pricing import price_decisions
from ..routing.side_features import TokenTables
from ..routing.state import RoutingState
from .attention import routed_attention
from .audit import CostAudit
from .kv_cache import PagedKVCache
from .side_state import SideState, advance

NORM_EPS = 1e-5


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x): one expert, or the dense FFN."""

    def __init__(self, d_model: int, width: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, width, bias=False)
        self.w3 = nn.Linear(d_model, width, bias=False)
        self.w2 = nn.Linear(width, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class InferenceLayer(nn.Module):
    def __init__(self, config: TriRouteConfig, layer_number: int):
        super().__init__()
        m, r = config.model, config.router
        self.config = config
        self.layer_number = layer_number  # 0-based
        self.controller = build_controller(config, layer_number)
        self.attn_norm = nn.RMSNorm(m.d_model, eps=NORM_EPS)
        self.wq = nn.Parameter(torch.empty(m.n_heads, m.d_head, m.d_model))
        self.wk = nn.Parameter(torch.empty(m.n_kv_heads, m.d_head, m.d_model))
        self.wv = nn.Parameter(torch.empty(m.n_kv_heads, m.d_head, m.d_model))
        self.wo = nn.Parameter(torch.empty(m.d_model, m.n_heads, m.d_head))
        self.ffn_norm = nn.RMSNorm(m.d_model, eps=NORM_EPS)
        if r.expert_routing:
            width = expert_width(m, r)
            self.experts = nn.ModuleList(SwiGLU(m.d_model, width) for _ in range(r.num_experts))
            self.expert_macs = 3 * m.d_model * width
        else:
            self.ffn = SwiGLU(m.d_model, m.d_ff)
            self.expert_macs = 3 * m.d_model * m.d_ff
        self.controller_macs = sum(mod.weight.numel() for mod in self.controller.modules() if isinstance(mod, nn.Linear))

    def decide(self, x: torch.Tensor, side: torch.Tensor, leader: RouterOutput | None, positions: torch.Tensor,
               prices: torch.Tensor) -> RouterOutput:
        """Noise-free (priced) decisions of this layer for x (B, n, D), psi (B, n, F); `leader`: the
        layer group's attention decision a follower reuses (RoutingState.leader_output)."""
        out = self.controller(x, side, None, 1.0, leader)
        if self.config.router.kind != "triroute" or not bool(prices.ne(0).any()):
            return out
        # Prices depend on each token's position; price_decisions takes one position row.
        rows = [price_decisions(_take(out, b), prices, positions[b], self.config.model, self.config.router)
                for b in range(x.shape[0])]
        return _cat(rows)

    def forward(self, x, out: RouterOutput, positions, valid, cache, rids, audit):
        r = self.config.router
        if audit is not None:
            audit.add(self.layer_number, "controller", int(valid.sum()) * self.controller_macs)
        mode = out.attn.y.argmax(-1)  # (B, n, H) executed read modes
        bit_option = out.bits.y.argmax(-1)  # (B, n)
        x = x + routed_attention(self.attn_norm(x), self.wq, self.wk, self.wv, self.wo, mode, bit_option,
                                 positions, valid, cache, self.layer_number, rids, r.window, audit)
        return x + self._ffn(self.ffn_norm(x), out, valid, audit)

    def _ffn(self, h: torch.Tensor, out: RouterOutput, valid: torch.Tensor, audit: CostAudit | None) -> torch.Tensor:
        """Experts grouped by expert (each runs once, on its tokens only); null runs nothing."""
        B, n, D = h.shape
        flat = h.reshape(B * n, D)
        result = torch.zeros_like(flat)
        ok = valid.flatten()
        if out.experts is None:
            rows = ok.nonzero().flatten()
            result[rows] = self.ffn(flat[rows])
            routes = rows.numel()
        else:
            index = out.experts.index.reshape(B * n, -1)
            weight = out.experts.weight.reshape(B * n, -1)
            routes = 0
            for e, expert in enumerate(self.experts):
                rows, slots = ((index == e) & ok[:, None]).nonzero(as_tuple=True)
                if rows.numel():
                    result.index_add_(0, rows, weight[rows, slots, None].to(h.dtype) * expert(flat[rows]))
                    routes += rows.numel()
        if audit is not None:
            audit.add(self.layer_number, "experts", routes * self.expert_macs)
        return result.view(B, n, D)


class InferenceModel(nn.Module):
    """Embedding, L routed layers, final norm, LM head; token tables for psi."""

    def __init__(self, config: TriRouteConfig, tables: TokenTables | None = None):
        super().__init__()
        m = config.model
        self.config = config
        self.embed = nn.Embedding(m.vocab_size, m.d_model)
        self.layers = nn.ModuleList(InferenceLayer(config, i) for i in range(m.n_layers))
        self.final_norm = nn.RMSNorm(m.d_model, eps=NORM_EPS)
        self.lm_head = nn.Linear(m.d_model, m.vocab_size, bias=False)
        self.register_buffer("prices", torch.zeros(2, dtype=torch.float64))
        tables = tables or TokenTables.uniform(m.vocab_size)
        self.register_buffer("token_log_prob", tables.log_prob.float().clone())
        self.register_buffer("token_word_start", tables.word_start.bool().clone())
        self.eod_id = tables.eod_id
        self.eval()

    @property
    def tables(self) -> TokenTables:
        return TokenTables(self.token_log_prob, self.token_word_start, self.eod_id)

    @property
    def device(self) -> torch.device:
        """Where the weights live: every tensor the engine creates goes there."""
        return self.lm_head.weight.device

    def new_cache(self, page_size: int = 16, initial_pages: int = 4) -> PagedKVCache:
        m, r = self.config.model, self.config.router
        bits = r.bits if r.bit_routing else (r.uniform_bits,)
        return PagedKVCache(m.n_layers, tuple(bits), m.n_kv_heads, m.d_head, r.group_size_for(m), page_size,
                            initial_pages, self.device)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, lengths: torch.Tensor, states: list[SideState], cache: PagedKVCache,
             rids: list[int], audit: CostAudit | None = None, all_logits: bool = False):
        """Consume the next `lengths[b]` tokens of each request (tokens (B, n), right-padded).
        Returns the logits (B, V) of each request's last new token, or (B, n, V) with `all_logits`,
        and the per-layer decisions (RouterOutput list) of this step."""
        m, r = self.config.model, self.config.router
        B, n = tokens.shape
        dev = self.device
        tokens, lengths = tokens.to(dev), lengths.to(dev)
        start = torch.tensor([s.length for s in states], dtype=torch.long, device=dev)
        positions = start.view(B, 1) + torch.arange(n, device=dev).view(1, n)
        valid = torch.arange(n, device=dev).view(1, n) < lengths.view(B, 1)
        static = advance(tokens, lengths, states, self.tables, r.max_doc_position)
        x = self.embed(tokens)
        state, outs = RoutingState.initial(self.config, B, n, dev), []
        for layer in self.layers:
            out = layer.decide(x, torch.cat([static, state.decisions], -1), state.leader_output(), positions,
                               self.prices)
            x = layer(x, out, positions, valid, cache, rids, audit)
            state = state.after(out, self.config)
            outs.append(out)
        x = self.final_norm(x)
        if not all_logits:
            x = x[torch.arange(B, device=dev), (lengths - 1).clamp_min(0)]
        logits = self.lm_head(x)
        if audit is not None:
            count = int(valid.sum())
            audit.tokens += count
            audit.lm_head += (count if all_logits else B) * m.d_model * m.vocab_size
            audit.dense_macs += float(dense_cost(positions[valid], m).flops.sum()) * m.n_layers
            audit.dense_kv_bytes += count * m.n_layers * 2 * m.d_kv * 2
        return logits, outs


def _take(obj, b: int):
    """Request b of a batched RouterOutput (every tensor field is batch-first)."""
    if torch.is_tensor(obj):
        return obj[b : b + 1]
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(obj, **{f.name: _take(getattr(obj, f.name), b) for f in dataclasses.fields(obj)})
    return obj


def _cat(items: list):
    first = items[0]
    if torch.is_tensor(first):
        return torch.cat(items, 0)
    if dataclasses.is_dataclass(first):
        return dataclasses.replace(first, **{f.name: _cat([getattr(i, f.name) for i in items])
                                            for f in dataclasses.fields(first)})
    return first
