"""Routed self-attention on Megatron-Core's tensor-parallel linears (GQA, RoPE).

Per query head and token the controller picks skip / local / full (reads); per token the bit
head picks the precision its own K/V are written at (writes). Two execution paths:

- relaxed (training): every head computes local and full attention over the *written* K/V and
  mixes them with the straight-through one-hots, out = sum_m y[m] Attn^(m) (Alg. 1), so the LM
  loss reaches the attention and bit heads.
- hard (inference, `hard=True`): only what the decisions select executes: no query or output
  projection for a skipped (token, head), each query reads exactly its window, and K/V are
  projected only for keys some query reads. Slow (per token), it is the executed-cost ground
  truth the inference kernels are tested against.

Tensor parallel: rank r owns query heads [r H/tp, (r+1) H/tp) and their kv heads; the QKV
weight uses Megatron's grouped layout [q heads of group g | k_g | v_g] per kv head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from ..config import TriRouteConfig
from ..routing.modes import READING_MODES, SKIP, read_start
from ..routing.quant import fake_quantize, relaxed_kv_write
from .mode_attention import MODE_ATTENTION



@dataclass
class RoutedAttentionSubmodules:
    linear_qkv: ModuleSpec | type
    linear_proj: ModuleSpec | type


def routed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, modes: torch.Tensor, window: int) -> torch.Tensor:
    """Relaxed routed attention, out = sum_m y[m] * Attn^(m) (Alg. 1, line 4): q (B, T, H, d),
    k/v (B, T, H_kv, d) written values, modes (B, T, H, 3) -> (B, T, H, d). Same math as
    `routing.reference.reference_attention`; each mode's attention costs only the keys it reads
    (`mode_attention`), so the mode head's gradient <dL/dout, Attn^(m)> stays exact."""
    out = None
    for mode in READING_MODES:
        weight = modes[..., mode, None]
        if not weight.requires_grad and not bool(weight.any()):
            continue  # a mode nobody reads and no gradient needs (e.g. local in a dense model)
        term = weight.to(q.dtype) * MODE_ATTENTION[mode](q, k, v, window)  # (B, T, H, d)
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
        """[T, B, kv_local * (group + 2) * d] -> q [T, B, H_l, d], k, v [T, B, kv_l, d]."""
        T, B = mixed.shape[:2]
        mixed = mixed.view(T, B, self.kv_local, self.group + 2, self.d_head)
        q = mixed[:, :, :, : self.group].reshape(T, B, self.heads_local, self.d_head)
        return q, mixed[:, :, :, self.group], mixed[:, :, :, self.group + 1]

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
                bit_index: torch.Tensor, rotary_pos_emb=None, hard: bool = False) -> torch.Tensor:
        """hidden [T, B, d] (normed); modes (B, T, H_local, 3); bit_weights (B, T, |bits|) ST
        one-hots; bit_index (B, T) executed option (hard path). Returns [T, B, d]."""
        if hard:
            return self._forward_hard(hidden, modes.argmax(-1), bit_index, rotary_pos_emb)
        mixed, _ = self.linear_qkv(hidden)
        q, k, v = self._split_qkv(mixed)
        q, k = self._rope(q, rotary_pos_emb), self._rope(k, rotary_pos_emb)
        g = self.triroute.router.group_size_for(self.triroute.model)
        to_bt = lambda t: t.transpose(0, 1)  # [T, B, ...] -> (B, T, ...)
        # K and V written in one call: quantisation groups never span heads, so stacking V's heads
        # after K's changes no group. (B, T, 2 * kv_l, d) -> k_w, v_w (B, T, kv_l, d)
        k_w, v_w = relaxed_kv_write(to_bt(torch.cat([k, v], 2)), bit_weights, self._bits(), g).chunk(2, dim=2)
        ctx = routed_attention(to_bt(q), k_w, v_w, modes, self.triroute.router.window)  # (B, T, H_l, d)
        out, _ = self.linear_proj(ctx.transpose(0, 1).reshape(hidden.shape[0], hidden.shape[1], -1))
        return out

    @torch.no_grad()
    def _forward_hard(self, hidden, mode_index, bit_index, rotary_pos_emb) -> torch.Tensor:
        """Execute only the selected reads (see module docstring). mode_index (B, T, H_local)."""
        T, B, d_model = hidden.shape
        d, G = self.d_head, self.group
        W = self.linear_qkv.weight.view(self.kv_local, G + 2, d, d_model)
        W_o = self.linear_proj.weight.view(d_model, self.heads_local, d)
        freqs = None
        if rotary_pos_emb is not None:
            freqs = (rotary_pos_emb[0] if isinstance(rotary_pos_emb, tuple) else rotary_pos_emb)[:T]
        out = hidden.new_zeros(T, B, d_model)
        for b in range(B):
            x = hidden[:, b]  # (T, d_model)
            for kv in range(self.kv_local):
                heads = range(kv * G, (kv + 1) * G)
                starts = self._read_starts(mode_index[b, :, kv * G : (kv + 1) * G])  # (T, G), -1 = skip
                if bool((starts < 0).all()):
                    continue  # nobody in this group reads: no K/V, no Q, no output work
                k, v = self._written_kv(x, W[kv, G], W[kv, G + 1], self._keys_read(starts), bit_index[b], freqs)
                for j, h in enumerate(heads):
                    tokens = (starts[:, j] >= 0).nonzero().flatten()
                    if tokens.numel() == 0:
                        continue
                    q = x[tokens] @ W[kv, j].T  # query projection for reading tokens only
                    if freqs is not None:
                        q = self._rope(q.view(-1, 1, 1, d), freqs[tokens]).view(-1, d)
                    ctx = torch.empty_like(q)
                    for i, t in enumerate(tokens.tolist()):
                        lo = int(starts[t, j])
                        probs = (q[i : i + 1] @ k[lo : t + 1].T / math.sqrt(d)).softmax(-1)  # (1, n)
                        ctx[i] = (probs @ v[lo : t + 1]).view(d)
                    out[tokens, b] += ctx @ W_o[:, h].T  # output projection for reading tokens only
        return tensor_parallel.reduce_from_tensor_model_parallel_region(out)

    def _read_starts(self, modes: torch.Tensor) -> torch.Tensor:
        """(T, G) first key each (token, head) reads: 0 for full, t - w for local, -1 for skip."""
        T = modes.shape[0]
        t = torch.arange(T, device=modes.device).view(T, 1).expand_as(modes)
        start = read_start(t, modes, self.triroute.router.window)
        return torch.where(modes == SKIP, torch.full_like(t, -1), start)

    @staticmethod
    def _keys_read(starts: torch.Tensor) -> torch.Tensor:
        """(T,) bool: key s is read by some (t, h) with start <= s <= t."""
        T = starts.shape[0]
        s = torch.arange(T, device=starts.device).view(T, 1, 1)  # key
        t = torch.arange(T, device=starts.device).view(1, T, 1)  # query
        return ((starts.unsqueeze(0) >= 0) & (starts.unsqueeze(0) <= s) & (s <= t)).flatten(1).any(-1)

    def _written_kv(self, x, W_k, W_v, needed, bit_index, freqs):
        """K/V (T, d) as written to the cache, projected only at `needed` positions (zeros elsewhere)."""
        T, d = x.shape[0], self.d_head
        g = self.triroute.router.group_size_for(self.triroute.model)
        bits = self._bits()
        rows = needed.nonzero().flatten()
        k, v = x.new_zeros(T, d), x.new_zeros(T, d)
        k_rows, v_rows = x[rows] @ W_k.T, x[rows] @ W_v.T
        if freqs is not None:
            k_rows = self._rope(k_rows.view(-1, 1, 1, d), freqs[rows]).view(-1, d)
        for option, width in enumerate(bits):
            sel = bit_index[rows] == option
            if bool(sel.any()):
                k[rows[sel]] = fake_quantize(k_rows[sel].view(-1, 1, d), width, g).view(-1, d)
                v[rows[sel]] = fake_quantize(v_rows[sel].view(-1, 1, d), width, g).view(-1, d)
        return k, v
