"""Routed attention over the paged cache: one write and one read op per layer, tensor ops only.

Every valid token writes its K/V to the pool of its chosen width (skip is a read decision) with
the kernels' one cache write. Then every token is one query row of the kernels' one attention op
over all precision pools (`triroute_kernels.paged_attention`: one online softmax across pools,
work per (row, KV head) with all its query heads): query head h of a row reads keys lo..t, where
`read_start` gives lo from its mode (a skipping head gets the empty range lo = t + 1 and a zero
context). Q, K, V and O are one matmul each over all heads; a skipping head's Q is computed and
never read, and its zero context adds nothing through O (at one token per request the weights
are read whole either way). Prefill and decode take the same path: a prompt's tokens are rows
with their own positions.

`attend` is the step's part (no host read). `routed_attention` wraps it for one layer called on
its own (tests, tools): the cache's `before_step` / `after_step` around it, then the audit.
"""

from __future__ import annotations

import functools
import math

import torch

from triroute_kernels import decode_linear, few_rows, paged_attention

from ..routing.modes import read_start
from .audit import CostAudit, count_attention
from .kv_cache import PagedKVCache


@functools.lru_cache(maxsize=16)
def _inv_freq(d: int, base: float, device: torch.device) -> torch.Tensor:
    """(d/2,) the rotary frequencies, made once per (d, base, device) (a normal tensor, also when
    first asked for under inference mode)."""
    with torch.inference_mode(False):
        return 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))


def rope_tables(positions: torch.Tensor, d: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (N, 1, d), of the rotary embedding (Megatron's non-interleaved form) at positions (N,)."""
    freqs = positions.to(torch.float32).view(-1, 1) * _inv_freq(d, base, positions.device).view(1, -1)  # (N, d/2)
    emb = torch.cat([freqs, freqs], -1).unsqueeze(1)  # (N, 1, d)
    return emb.cos(), emb.sin()


class RopeCache:
    """`rope_tables` of positions 0 .. size - 1, computed once and grown by doubling; a step looks its
    positions up (two row gathers) instead of computing its tables (seven ops). Each row is the same
    elementwise ops on the same position as `rope_tables` computes, so the same values bit for bit
    (tests/inference/test_routed_attention.py). Positions on the host, as the scheduler has them."""

    def __init__(self, d: int, base: float = 10000.0):
        self.d, self.base = d, base
        self.cos = self.sin = torch.empty(0, 1, d)

    def __call__(self, positions: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (N, 1, d), at positions (N,) on the host, none above `top`."""
        if top >= self.cos.shape[0]:
            with torch.inference_mode(False):  # normal tensors: kept across inference-mode calls
                self.cos, self.sin = rope_tables(torch.arange(max(2 * self.cos.shape[0], top + 1, 256)), self.d,
                                                 self.base)
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (N, heads, d) rotated by tables (N, 1, d) from `rope_tables`."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat([-x2, x1], -1) * sin.to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding (Megatron's non-interleaved form): x (N, heads, d), positions (N,)."""
    return apply_rope(x, *rope_tables(positions, x.shape[-1], base))


def projection_views(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, wo: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """wq (H, d, D), wk/wv (H_kv, d, D), wo (D, H, d) as the weights `attend` applies (nn.Linear's
    layout, out x in): (H d, D), (H_kv d, D), (H_kv d, D), (D, H d). Views of the parameters, no copy."""
    D = wq.shape[2]
    return wq.reshape(-1, D), wk.reshape(-1, D), wv.reshape(-1, D), wo.reshape(D, -1)


def attend(h: torch.Tensor, w: tuple[torch.Tensor, ...], n_heads: int, mode: torch.Tensor, option: torch.Tensor,
           t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, valid: torch.Tensor | None, cache: PagedKVCache,
           layer: int, rows: torch.Tensor, n: int, window: int) -> torch.Tensor:
    """h (N, D) normed inputs of B requests, n tokens each (request-major, N = B n); w the
    `projection_views` of the layer's Q, K, V, O; mode (N, H) in ATTN_MODES order; option (N,) bit
    option; t (N,) positions; cos/sin (N, 1, d) their rotary tables; valid (N,) (None: all valid);
    rows (B,) the requests' cache rows. Returns (N, D). Tensor ops only; room reserved beforehand."""
    wq, wk, wv, wo = w
    N, H = h.shape[0], n_heads
    d = wq.shape[0] // H
    n_kv = wk.shape[0] // d
    if few_rows(h):  # one call: the three projections and the rotation, bit for bit these ops
        q, k, v = torch.ops.triroute.decode_qkv(*(x.contiguous() for x in (h, wq, wk, wv, cos.view(N, d), sin.view(N, d))))
    else:
        qk = apply_rope(torch.cat([decode_linear(h, wq), decode_linear(h, wk)], -1).view(N, H + n_kv, d), cos, sin)
        q, k, v = qk[:, :H], qk[:, H:], decode_linear(h, wv).view(N, n_kv, d)
    cache.write_step(layer, rows, option, t, k, v, valid, n)
    lo = read_start(t.view(N, 1), mode, window)  # skip: t + 1, an empty range
    if valid is not None:
        lo = torch.where(valid.view(N, 1), lo, t.view(N, 1) + 1)
    request = rows.repeat_interleave(n) if n > 1 else rows
    context = paged_attention(q.contiguous(), cache.layers[layer].lists(), cache.layer_tables[layer], request,
                              lo, t, 1.0 / math.sqrt(d), cache.layer_executed[layer])
    return decode_linear(context.view(N, H * d), wo)


def routed_attention(h: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, wo: torch.Tensor,
                     mode: torch.Tensor, bit_option: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                     cache: PagedKVCache, layer: int, rids: list[int], window: int,
                     audit: CostAudit | None) -> torch.Tensor:
    """One layer's `attend` on its own: h (B, n, D) normed input; mode (B, n, H); bit_option,
    positions, valid (B, n). The cache's `before_step` and `after_step` around it, as a model step
    has them, then the audit. Returns (B, n, D)."""
    B, n, D = h.shape
    d = wq.shape[1]
    cache.before_step(rids, n, audit is not None)
    t = positions.reshape(-1)
    rows = cache.rows(rids)
    cos, sin = rope_tables(t, d)
    out = attend(h.reshape(B * n, D), projection_views(wq, wk, wv, wo), wq.shape[0], mode.reshape(B * n, -1),
                 bit_option.reshape(-1), t, cos, sin, valid.reshape(-1), cache, layer, rows, n, window)
    cache.after_step(rids, n)
    if audit is not None:
        count_attention(audit, [layer], cache, rows.repeat_interleave(n), mode.reshape(1, B * n, -1),
                        bit_option.reshape(1, -1), t, valid.reshape(-1), window, D)
        audit.take_executed(cache)
    return out.view(B, n, D)
