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

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from triroute_kernels import choose_backend, decode_linear, few_rows, rms_norm, routed_experts

from ..config import TriRouteConfig
from ..routing.controller import RouterOutput
from ..routing.cost import dense_cost, expert_width, hard_cost
from ..routing.factory import build_controller
from ..routing.modes import reach_by_mode
from ..routing.pricing import PriceShifts, price_decisions, price_shifts
from ..routing.side_features import TokenTables
from ..routing.state import RoutingState
from ..routing.versions import version_key
from .attention import RopeCache, attend, projection_views
from .audit import CostAudit, count_attention
from .fused_step import LayerDecisions, decode_layers, fused_plan
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
        """x (..., D) -> (..., D)."""
        return decode_linear(F.silu(decode_linear(x, self.w1.weight)) * decode_linear(x, self.w3.weight),
                             self.w2.weight)


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
               prices: PriceShifts | None) -> RouterOutput:
        """Noise-free (priced) decisions of this layer for x (B, n, D), psi (B, n, F); `leader`: the
        layer group's attention decision a follower reuses (RoutingState.leader_output); `prices`:
        the step's price shifts, one row per request (the model's prices, or a request's own budget,
        inference/serve_budget.py); None: the plain argmax (prices 0)."""
        if self.config.router.kind != "triroute" or prices is None:
            return self.controller(x, side, None, 1.0, leader)
        out = self.controller(x, side, None, 1.0, leader, decide=False)  # the priced argmax decides every axis
        return price_decisions(out, prices, positions, self.config.model, self.config.router)

    @property
    def as_defined(self) -> bool:
        """Whether this layer decides and runs as `InferenceLayer` defines it (neither `decide` nor
        `forward` replaced, on it or by a subclass): what a step's layers in one call compute."""
        cls = type(self)
        return cls.decide is InferenceLayer.decide and cls.forward is InferenceLayer.forward and \
            "decide" not in vars(self) and "forward" not in vars(self)

    fused: bool = True
    """A decode step's layer (one token per request, every token valid, routed experts) on a CPU where
    the C++ kernels are built runs as one call, `torch.ops.triroute.decode_layer`: the ops below, the
    same kernels in the same order (the same bits), without the Python between them. False: op by op."""

    def forward(self, x: torch.Tensor, out: RouterOutput, batch: "StepBatch", cache: PagedKVCache) -> torch.Tensor:
        """x (B, n, D) -> (B, n, D) with this layer's decisions `out`; tensor ops only."""
        B, n, D = x.shape
        N = B * n
        mode = out.attn.hard.reshape(N, -1)  # (N, H) executed read modes (eval: hard is what y encodes)
        option = out.bits.hard.reshape(N)
        if self.fused and n == 1 and batch.valid is None and out.experts is not None and few_rows(x.view(N, D)):
            return self._decode_layer(x.view(N, D), out, batch, cache, mode, option).view(B, n, D)
        h = rms_norm(x, self.attn_norm.weight, self.attn_norm.eps).view(N, D)
        x = x + attend(h, self.projections(), self.config.model.n_heads, mode, option, batch.t, batch.cos, batch.sin,
                       batch.valid, cache, self.layer_number, batch.rows, n, self.config.router.window).view(B, n, D)
        return x + self._ffn(rms_norm(x, self.ffn_norm.weight, self.ffn_norm.eps), out, batch.valid)

    def _decode_layer(self, x: torch.Tensor, out: RouterOutput, batch: "StepBatch", cache: PagedKVCache,
                      mode: torch.Tensor, option: torch.Tensor) -> torch.Tensor:
        """`forward` of a decode step's rows x (N, D) in one C++ call (see `fused`)."""
        N, layer = x.shape[0], self.layer_number
        pools = cache.layers[layer].lists()
        return torch.ops.triroute.decode_layer(
            x.contiguous(), self.attn_norm.weight, self.attn_norm.eps, *self.projections(), batch.cos, batch.sin,
            mode.long(), reach_by_mode(self.config.router.window), option.long(), batch.rows, batch.t,
            cache.layer_counts[layer], cache.layer_tables[layer], cache.page_size, *pools.tensors, pools.bits,
            pools.group_size, 1.0 / math.sqrt(self.config.model.d_head), cache.layer_executed[layer], self.ffn_norm.weight,
            self.ffn_norm.eps, out.experts.index.reshape(N, -1).long(), out.experts.weight.reshape(N, -1).to(x.dtype),
            *self._expert_weights())

    def projections(self) -> tuple[torch.Tensor, ...]:
        """`attention.projection_views` of this layer's Q/K/V/O, taken once per parameter storage."""
        key = tuple((id(p), p.data_ptr()) for p in (self.wq, self.wk, self.wv, self.wo))
        if getattr(self, "_views_key", None) != key:
            self._views, self._views_key = projection_views(self.wq, self.wk, self.wv, self.wo), key
        return self._views

    def _ffn(self, h: torch.Tensor, out: RouterOutput, valid: torch.Tensor | None) -> torch.Tensor:
        """h (..., D) -> (..., D); valid (N,) or None (every token). Each chosen expert runs once, on
        its tokens only (`triroute_kernels.routed_experts`); the null expert and padding run nothing."""
        shape = h.shape
        h = h.reshape(-1, shape[-1])
        if out.experts is None:
            y = self.ffn(h)
            return (y if valid is None else y * valid.view(-1, 1)).view(shape)
        index = out.experts.index.reshape(h.shape[0], -1)  # (N, k); NULL_EXPERT = -1
        if valid is not None:
            index = torch.where(valid.view(-1, 1), index, -1)
        weights = self._expert_weights()
        if choose_backend(h.device) == "triton":  # a GPU's experts: stacked, read nothing back
            weights = self._stacked_experts(weights)
        return routed_experts(h, index, out.experts.weight.reshape(h.shape[0], -1).to(h.dtype), *weights).view(shape)

    def _expert_weights(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """(w1, w3, w2) of every expert, read from the modules' own tables (once per layer and step)."""
        experts = [e._modules for e in self._modules["experts"]._modules.values()]
        return tuple([e[name]._parameters["weight"] for e in experts] for name in ("w1", "w3", "w2"))

    def _stacked_experts(self, weights) -> tuple[torch.Tensor, ...]:
        """(w1 [E, F, D], w3, w2 [E, D, F]): a stacked copy of the experts' weights, what
        `routed_experts` takes on a GPU, made again whenever a weight's storage or version changes
        (a load or any in-place write). It costs one more copy of the experts' weights in device memory."""
        key = version_key(w for group in weights for w in group)
        if getattr(self, "_stacked_key", None) != key:
            self._stacked, self._stacked_key = tuple(torch.stack([w.detach() for w in group]) for group in weights), key
        return self._stacked

@dataclass
class StepBatch:
    """A step's device inputs, prepared on the host before it (`InferenceModel.prepare`); N = B n."""

    tokens: torch.Tensor
    """(B, n) right-padded."""
    positions: torch.Tensor
    """(B, n) sequence positions."""
    valid: torch.Tensor | None
    """(N,) False for padding; None when every token is valid (decode)."""
    side: torch.Tensor
    """(B, n, F) static side features psi."""
    rows: torch.Tensor
    """(B,) each request's row in the cache's decode state."""
    t: torch.Tensor
    """(N,) positions, flat."""
    cos: torch.Tensor
    sin: torch.Tensor
    """(N, 1, d) rotary tables at `t`, shared by every layer."""
    last: torch.Tensor | None
    """(B,) column of each request's last new token (None: n = 1)."""
    prices: PriceShifts | None
    """On the device, each request's price shifts (the model's prices or its own), computed on the
    host once for every layer; None: the plain argmax (the model's prices are 0)."""

    def valid_mask(self) -> torch.Tensor:
        """(N,) bool: `valid`, or every token when it is None (for the audit, after the step)."""
        return self.valid if self.valid is not None else torch.ones_like(self.t, dtype=torch.bool)


def hard_stacks(outs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A step's hard decisions, every layer stacked: modes (layers, B, n, H), bit options (layers,
    B, n), expert ids (layers, B, n, k) or None where no layer routes its FFN. A fused step's
    `LayerDecisions` give them from the call's tensors."""
    if isinstance(outs, LayerDecisions):
        return outs.hard_stacks()
    dense_ffn = [out.experts is None for out in outs]
    if any(dense_ffn) and not all(dense_ffn):
        raise ValueError("every layer must route its FFN, or none")
    index = None if dense_ffn[0] else torch.stack([out.experts.index for out in outs])
    return torch.stack([out.attn.hard for out in outs]), torch.stack([out.bits.hard for out in outs]), index


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
        self.rope = RopeCache(m.d_head)
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

    def host_prices(self) -> tuple[float, float]:
        """(mu_flops, mu_mem) as host floats, read from the buffer once per change."""
        key = version_key((self.prices,))
        if getattr(self, "_prices_key", None) != key:
            self._host_prices, self._prices_key = tuple(float(p) for p in self.prices), key
        return self._host_prices

    def host_tables(self) -> TokenTables:
        """The token tables on the host (the scheduler computes psi there; copied once per change)."""
        if self.device.type == "cpu":
            return self.tables
        key = version_key((self.token_log_prob, self.token_word_start))
        if getattr(self, "_host_tables_key", None) != key:
            self._host_tables = TokenTables(self.token_log_prob.cpu(), self.token_word_start.cpu(), self.eod_id)
            self._host_tables_key = key
        return self._host_tables

    def prepare(self, tokens: torch.Tensor, lengths: torch.Tensor, states: list[SideState], cache: PagedKVCache,
                rids: list[int], audit: CostAudit | None = None, prices: torch.Tensor | None = None) -> StepBatch:
        """Host side, before a step, on host tensors: psi (advancing `states`), room in the cache for
        the new tokens, the step's positions and rotary tables; then one copy of each to the device.
        With an audit, the kernels' executed counters start from zero for this step. `prices`: (B, 2)
        each request's own (None: the model's for all)."""
        B, n = tokens.shape
        cache.before_step(rids, n, audit is not None)
        dev = self.device
        tokens, lengths = tokens.cpu(), lengths.cpu()
        starts = [s.length for s in states]
        positions = torch.tensor(starts, dtype=torch.long).view(B, 1)
        if n > 1:
            positions = positions + torch.arange(n).view(1, n)
        valid = None if all(c == n for c in lengths.tolist()) else (torch.arange(n).view(1, n) < lengths.view(B, 1)).flatten()
        side = advance(tokens, lengths, states, self.host_tables(), self.config.router.max_doc_position)
        t = positions.flatten()
        cos, sin = self.rope(t, max(starts) + n - 1)
        last = None if n == 1 else (lengths - 1).clamp_min(0).to(dev)
        return StepBatch(tokens.to(dev), positions.to(dev), None if valid is None else valid.to(dev), side.to(dev),
                         cache.rows(rids), t.to(dev), cos.to(dev), sin.to(dev), last,
                         self._shifts(prices, positions))

    def _shifts(self, prices: torch.Tensor | None, positions: torch.Tensor) -> PriceShifts | None:
        """The step's price shifts on the device, computed on the host once for every layer:
        prices (B, 2) each request's own, or None for the model's (None again when those are 0:
        the plain argmax); positions (B, n)."""
        if prices is None:
            if self.config.router.kind != "triroute" or not any(self.host_prices()):
                return None
            prices = torch.tensor([self.host_prices()], dtype=torch.float64).expand(positions.shape[0], 2)
        attn_heads = max(1, max(layer.controller.attn_heads for layer in self.layers))
        return price_shifts(prices, positions, self.config.model, self.config.router, attn_heads).to(self.device)

    fused_step: bool = True
    """A decode step's layers in one call where they can (`inference.fused_step`); False: the layer
    loop (each layer one call or op by op, `InferenceLayer.fused`)."""

    def forward_step(self, batch: StepBatch, cache: PagedKVCache, all_logits: bool = False):
        """The step itself, tensor ops only (no host read): logits (B, V) of each request's last new
        token, or (B, n, V) with `all_logits`, and the per-layer decisions."""
        B, n = batch.tokens.shape
        x = self.embed(batch.tokens)
        plan = fused_plan(self, batch, x) if self.fused_step else None
        if plan is not None:  # a decode step's layers in one call (inference/fused_step.py)
            x, outs = decode_layers(self, x, batch, cache, plan)
        else:
            x, outs = self._layers(x, batch, cache)
        x = rms_norm(x, self.final_norm.weight, self.final_norm.eps)
        if not all_logits:
            x = x[:, 0] if batch.last is None else x[torch.arange(B, device=x.device), batch.last]
        return decode_linear(x.reshape(-1, x.shape[-1]), self.lm_head.weight).view(*x.shape[:-1], -1), outs

    def _layers(self, x: torch.Tensor, batch: StepBatch, cache: PagedKVCache) -> tuple[torch.Tensor, list[RouterOutput]]:
        """`forward_step`'s layers one by one: x after the last, each layer's decisions."""
        B, n = batch.tokens.shape
        state, outs = RoutingState.initial(self.config, B, n, x.device), []
        for layer in self.layers:
            out = layer.decide(x, torch.cat([batch.side, state.decisions], -1), state.leader_output(),
                               batch.positions, batch.prices)
            x = layer(x, out, batch, cache)
            state = state.after(out, self.config)
            outs.append(out)
        return x, outs

    def finish(self, batch: StepBatch, outs: list[RouterOutput], cache: PagedKVCache, rids: list[int],
               audit: CostAudit | None, all_logits: bool = False) -> None:
        """Host side, after a step: a prefill returns the pages its tokens did not fill; the audit
        counts the step from its decisions and the kernels' counters."""
        B, n = batch.tokens.shape
        cache.after_step(rids, n)
        if audit is None:
            return
        m = self.config.model
        valid = batch.valid_mask()
        N, L = batch.t.numel(), len(outs)
        rows = batch.rows.repeat_interleave(N // batch.rows.numel()) if N > batch.rows.numel() else batch.rows
        modes, options, index = hard_stacks(outs)
        count_attention(audit, [layer.layer_number for layer in self.layers], cache, rows, modes.view(L, N, -1),
                        options.view(L, N), batch.t, batch.valid, self.config.router.window, m.d_model)
        count = N if batch.valid is None else int(valid.sum())
        if index is not None:  # every layer's real routes in one count
            real = index.view(L, N, -1) >= 0
            routes = (real if batch.valid is None else real & valid.view(1, N, 1)).sum((1, 2))
        else:
            routes = valid.sum().expand(L)
        for layer, r in zip(self.layers, routes.tolist()):  # the controller on every valid token; each real route
            audit.add(layer.layer_number, "controller", count * layer.controller_macs)
            audit.add(layer.layer_number, "experts", r * layer.expert_macs)
        audit.take_executed(cache)
        audit.tokens += count
        audit.lm_head += (count if all_logits else B) * m.d_model * m.vocab_size
        audit.dense_kv_bytes += count * m.n_layers * 2 * m.d_kv * 2
        costs = self._row_costs(batch, modes, options, index)
        audit.dense_macs += sum(row[1] for row in costs)  # whole MAC counts in float64: the requests' sum, exactly
        audit.add_requests(rids, costs)

    def _row_costs(self, batch: StepBatch, modes: torch.Tensor, options: torch.Tensor,
                   index: torch.Tensor | None) -> list[list[float]]:
        """Per request of a finished step, over its valid tokens and all layers: [budgeted MACs,
        dense MACs, KV bits written, dense KV bits] (routing.cost's hard accounting), from every
        layer's stacked decisions (`hard_stacks`)."""
        m, r = self.config.model, self.config.router
        B, n = batch.tokens.shape
        valid = batch.valid_mask().view(B, n).double()
        L = modes.shape[0]
        # every layer at once: the layers stacked along hard_cost's batch axis
        cost = hard_cost(modes.reshape(L * B, n, -1), None if index is None else index.reshape(L * B, n, -1),
                         options.reshape(L * B, n), batch.positions.repeat(L, 1), m, r)
        valid_l = valid.repeat(L, 1)
        total = torch.stack([((cost.attn_key_macs + cost.expert_macs) * valid_l).view(L, B, n).sum((0, 2)),
                             (cost.kv_bits * valid_l).view(L, B, n).sum((0, 2))], -1)
        dense = dense_cost(batch.positions, m)
        per_layer = torch.stack([(dense.flops * valid).sum(1), (dense.mem * valid).sum(1)], -1) * m.n_layers
        return torch.stack([total[:, 0], per_layer[:, 0], total[:, 1], per_layer[:, 1]], -1).tolist()

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, lengths: torch.Tensor, states: list[SideState], cache: PagedKVCache,
             rids: list[int], audit: CostAudit | None = None, all_logits: bool = False,
             prices: torch.Tensor | None = None):
        """Consume the next `lengths[b]` tokens of each request (tokens (B, n), right-padded).
        Returns the logits (B, V) of each request's last new token, or (B, n, V) with `all_logits`,
        and the per-layer decisions (RouterOutput list) of this step. `prices`: (B, 2) each
        request's own (mu_flops, mu_mem); None: the model's for all."""
        batch = self.prepare(tokens, lengths, states, cache, rids, audit, prices)
        logits, outs = self.forward_step(batch, cache, all_logits)
        self.finish(batch, outs, cache, rids, audit, all_logits)
        return logits, outs

