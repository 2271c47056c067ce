"""Routed self-attention on Megatron-Core's tensor-parallel linears (GQA, RoPE).

Per query head and token the controller picks skip / local / full (reads); per token the bit
head picks the precision its own K/V are written at (writes). One execution path, batched:
every head computes local and full attention over the *written* K/V and mixes them with the
decisions' one-hots, out = sum_m y[m] Attn^(m) (Alg. 1). In training the one-hots are
straight-through, so the LM loss reaches the attention and bit heads; in eval mode they are the
noise-free (priced) decisions, and the mix gives the values (up to rounding) of executing only
what they select.

Hard-decision execution (only the selected reads run, K/V in a paged cache at their widths) is
the inference engine's (`inference.attention.routed_attention`); the engine is tested equal to
this module's eval-mode forward on the same decisions, and its cost counters are the
executed-cost reference.

Tensor parallel: rank r owns query heads [r H/tp, (r+1) H/tp) and their kv heads; the QKV
weight uses Megatron's grouped layout [q heads of group g | k_g | v_g] per kv head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from ..config import TriRouteConfig
from ..routing.compiled import routing_ops
from ..routing.modes import FULL, READING_MODES
from ..routing.quant import relaxed_kv_write
from .mode_attention import MODE_ATTENTION
from .mode_mix import ModeMix



@dataclass
class RoutedAttentionSubmodules:
    linear_qkv: ModuleSpec | type
    linear_proj: ModuleSpec | type


def routed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, modes: torch.Tensor | None, window: int,
                     local: str = "auto") -> torch.Tensor:
    """Relaxed routed attention, out = sum_m y[m] * Attn^(m) (Alg. 1, line 4): q (B, T, H, d),
    k/v (B, T, H_kv, d) written values, modes (B, T, H, N_MODES) -> (B, T, H, d). Same math as the
    tests' oracle `tests/oracles.reference_attention`; each mode's attention costs only the keys it
    reads (`mode_attention`; `local`: the local mode's kernel, `router.local_attention`), so the
    mode head's gradient <dL/dout, Attn^(m)> stays exact. modes None: every head of every token
    reads everything (attention not routed): the full attention alone, with no mode weight read."""
    if modes is None:
        return MODE_ATTENTION[FULL](q, k, v, window, local)
    if modes.requires_grad and torch.is_grad_enabled():  # training: the mix and its backward as one node
        return ModeMix.apply(modes, *(MODE_ATTENTION[m](q, k, v, window, local) for m in READING_MODES))
    out = None
    for mode in READING_MODES:
        weight = modes[..., mode, None]
        if not weight.requires_grad and not bool(weight.any()):
            continue  # a mode nobody reads and no gradient needs (e.g. local in a dense model)
        term = weight.to(q.dtype) * MODE_ATTENTION[mode](q, k, v, window, local)  # (B, T, H, d)
        out = term if out is None else out + term
    return torch.zeros_like(q) if out is None else out


class TriRouteSelfAttention(MegatronModule):
    """Built as (config, triroute, layer_number, submodules); see module docstring."""

    def __init__(self, config: TransformerConfig, triroute: TriRouteConfig, layer_number: int,
                 submodules: RoutedAttentionSubmodules, pg_collection=None):
        super().__init__(config=config)
        m = triroute.model
        self.triroute = triroute
        self.layer_number = layer_number
        tp = config.tensor_model_parallel_size
        self.heads_local = m.n_heads // tp
        self.kv_local = m.n_kv_heads // tp
        self.d_head = m.d_head
        self.group = m.n_heads // m.n_kv_heads  # query heads per kv head
        self.linear_qkv = build_module(
            submodules.linear_qkv, m.d_model, (m.n_heads + 2 * m.n_kv_heads) * m.d_head, config=config,
            init_method=config.init_method, gather_output=False, bias=False, skip_bias_add=False,
            is_expert=False, tp_comm_buffer_name="qkv",
        )
        self.linear_proj = build_module(
            submodules.linear_proj, m.n_heads * m.d_head, m.d_model, config=config,
            init_method=config.output_layer_init_method, bias=False, input_is_parallel=True,
            skip_bias_add=True, is_expert=False, tp_comm_buffer_name="proj",
        )

    # -- helpers ---------------------------------------------------------------------------
    def _split_qkv(self, mixed: torch.Tensor):
        """[T, B, kv_local * (group + 2) * d] -> q [T, B, H_l, d], k, v [T, B, kv_l, d]. One split
        (its backward is one concatenation; an integer index into `mixed` would give each of k and v
        a full-size zero gradient to add)."""
        T, B = mixed.shape[:2]
        q, k, v = mixed.view(T, B, self.kv_local, self.group + 2, self.d_head).split([self.group, 1, 1], dim=3)
        return q.reshape(T, B, self.heads_local, self.d_head), k.squeeze(3), v.squeeze(3)

    def _rope(self, t: torch.Tensor, rotary_pos_emb) -> torch.Tensor:
        if rotary_pos_emb is None:
            return t
        freqs = rotary_pos_emb[0] if isinstance(rotary_pos_emb, tuple) else rotary_pos_emb
        return apply_rotary_pos_emb(t, freqs[: t.shape[0]], config=self.config)

    def _bits(self):
        r = self.triroute.router
        return r.bits if r.bit_routing else (r.uniform_bits,)

    # -- forward ---------------------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, modes: torch.Tensor, bit_weights: torch.Tensor,
                rotary_pos_emb=None) -> torch.Tensor:
        """hidden [T, B, d] (normed); modes (B, T, H_local, 3) (None: every head full) and bit_weights
        (B, T, |bits|) one-hots (straight-through in training). Returns [T, B, d]."""
        mixed, _ = self.linear_qkv(hidden)
        q, k, v = self._split_qkv(mixed)
        q, k = self._rope(q, rotary_pos_emb), self._rope(k, rotary_pos_emb)
        g = self.triroute.router.group_size_for(self.triroute.model)
        to_bt = lambda t: t.transpose(0, 1)  # [T, B, ...] -> (B, T, ...)
        # K and V written in one call: quantisation groups never span heads, so stacking V's heads
        # after K's changes no group. (B, T, 2 * kv_l, d) -> k_w, v_w (B, T, kv_l, d)
        router = self.triroute.router
        quantize = routing_ops(router.compile).quantize
        k_w, v_w = relaxed_kv_write(to_bt(torch.cat([k, v], 2)), bit_weights, self._bits(), g, quantize).chunk(2, dim=2)
        ctx = routed_attention(to_bt(q), k_w, v_w, modes, router.window, router.local_attention)  # (B, T, H_l, d)
        out, _ = self.linear_proj(ctx.transpose(0, 1).reshape(hidden.shape[0], hidden.shape[1], -1))
        return out
