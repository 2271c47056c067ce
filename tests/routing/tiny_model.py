"""A pure-PyTorch TriRoute stack for end-to-end routing tests (no Megatron)."""

import torch
import torch.nn.functional as F
from torch import nn

from megatron_triroute import TriRouteController
from megatron_triroute.routing.controller import decision_features
from megatron_triroute.routing.cost import expert_width
from megatron_triroute.routing.noise import NoiseKey
from megatron_triroute.routing.quant import relaxed_kv_write
from tests.oracles import combine_experts, reference_attention, swiglu
from megatron_triroute.routing.side_features import TokenTables, static_side_features


class TinyRoutedLM(nn.Module):
    def __init__(self, cfg, tables: TokenTables):
        super().__init__()
        m, r = cfg.model, cfg.router
        self.cfg, self.tables = cfg, tables
        self.embed = nn.Embedding(m.vocab_size, m.d_model)
        self.controllers = nn.ModuleList(TriRouteController(cfg, i) for i in range(m.n_layers))
        self.qkv = nn.ModuleList(nn.Linear(m.d_model, m.d_model + 2 * m.d_kv, bias=False) for _ in range(m.n_layers))
        self.proj = nn.ModuleList(nn.Linear(m.d_model, m.d_model, bias=False) for _ in range(m.n_layers))
        d_e = expert_width(m, r)
        self.w = nn.ParameterList(nn.Parameter(torch.randn(r.num_experts, 3, m.d_model, d_e) * 0.1) for _ in range(m.n_layers))
        self.w2 = nn.ParameterList(nn.Parameter(torch.randn(r.num_experts, d_e, m.d_model) * 0.1) for _ in range(m.n_layers))
        self.head = nn.Linear(m.d_model, m.vocab_size, bias=False)

    def forward(self, tokens, sample_index, step=0, tau=1.0):
        m, r = self.cfg.model, self.cfg.router
        B, T = tokens.shape
        x = self.embed(tokens)
        static = static_side_features(tokens, self.tables, r.max_doc_position)
        prev, outs = None, []
        for layer in range(m.n_layers):
            side = torch.cat([static, decision_features(prev, B, T, len(r.bits), r.top_k)], -1)
            key = NoiseKey(self.cfg.seed, step, layer, sample_index, torch.arange(T))
            out = self.controllers[layer](x, side, key, tau, prev)
            h = F.rms_norm(x, (m.d_model,))
            q, k, v = self.qkv[layer](h).split([m.d_model, m.d_kv, m.d_kv], -1)
            q = q.view(B, T, m.n_heads, m.d_head)
            k = k.view(B, T, m.n_kv_heads, m.d_head)
            v = v.view(B, T, m.n_kv_heads, m.d_head)
            if r.bit_routing:
                g = r.group_size_for(m)
                k, v = relaxed_kv_write(k, out.bits.y, r.bits, g), relaxed_kv_write(v, out.bits.y, r.bits, g)
            a = reference_attention(q, k, v, out.attn.y, r.window)
            x = x + self.proj[layer](a.reshape(B, T, m.d_model))
            h = F.rms_norm(x, (m.d_model,)).reshape(B * T, m.d_model)
            experts = [swiglu(w[0], w[2], w2) for w, w2 in zip(self.w[layer], self.w2[layer])]
            ffn = combine_experts(h, out.experts.index.view(B * T, -1), out.experts.weight.view(B * T, -1), experts)
            x = x + ffn.view(B, T, m.d_model)
            prev = out
            outs.append(out)
        return self.head(x), outs
