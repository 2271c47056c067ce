"""Routed attention over the paged cache, executing only the selected reads.

Every valid token first writes its K/V to the pool of its chosen width (skip is a read
decision). Then per query head h, only the (token, h) pairs whose mode is not `skip` get a
query projection, read keys and an output projection: `local` reads keys at positions
max(0, t - w)..t, `full` 0..t. Heads of one KV group may take different modes.

Prefill and decode take one read path: every new token is one query row of the kernels'
`triroute_kernels.decode_attention_pool`, called once per precision pool for all rows and heads
(the torch twin on CPU, the Triton kernel on CUDA) with the row's request's page table, keys
lo..t (a skipping head gets the empty range lo = t + 1); the pools' partials are merged by
their log-sum-exp (`merge_partials`). The kernels keep the online softmax, bounded scratch
included: the engine has none of its own. Work is vectorised over the batch and the reading
tokens; the Python loops run over pools, heads and (for long prompts) row blocks, never over
tokens.
"""

from __future__ import annotations

import math

import torch

from triroute_kernels import decode_attention_pool, merge_partials

from ..routing.modes import SKIP, read_start
from .audit import CostAudit
from .kv_cache import PagedKVCache

ROW_BLOCKS = 1 << 22
"""Cap on (row, kv head, page) entries per kernel call: a long prompt's rows go in several calls,
so the page tables and the kernels' block lists stay O(ROW_BLOCKS), not O(prompt x context)."""


def rope_tables(positions: torch.Tensor, d: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (N, 1, d), of the rotary embedding (Megatron's non-interleaved form) at positions (N,)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32, device=positions.device) / d))
    freqs = positions.to(torch.float32).view(-1, 1) * inv_freq.view(1, -1)  # (N, d/2)
    emb = torch.cat([freqs, freqs], -1).unsqueeze(1)  # (N, 1, d)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (N, heads, d) rotated by tables (N, 1, d) from `rope_tables`."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat([-x2, x1], -1) * sin.to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding (Megatron's non-interleaved form): x (N, heads, d), positions (N,)."""
    return apply_rope(x, *rope_tables(positions, x.shape[-1], base))


def routed_attention(h: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, wo: torch.Tensor,
                     mode: torch.Tensor, bit_option: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                     cache: PagedKVCache, layer: int, rids: list[int], window: int,
                     audit: CostAudit | None) -> torch.Tensor:
    """h (B, n, D) normed input; wq (H, d, D), wk/wv (H_kv, d, D), wo (D, H, d); mode (B, n, H)
    in ATTN_MODES order; bit_option (B, n); positions, valid (B, n). Returns (B, n, D)."""
    B, n, D = h.shape
    H, d = wq.shape[:2]
    n_kv = wk.shape[0]
    flat_h = h.reshape(B * n, D)
    tokens = valid.flatten().nonzero().flatten()  # (N,) valid flat indices, request-major then position
    batch_of = torch.arange(B, device=h.device).repeat_interleave(n)
    pos_flat = positions.flatten()

    # --- writes: every token, at its chosen width ---------------------------------------------
    x = flat_h[tokens]
    cos, sin = rope_tables(pos_flat[tokens], d)  # once per call: shared by K and every head's Q
    k = apply_rope(torch.einsum("nD,hdD->nhd", x, wk), cos, sin)
    v = torch.einsum("nD,hdD->nhd", x, wv)
    written = cache.bytes_written
    cache.write(layer, rids, batch_of[tokens], bit_option.flatten()[tokens], pos_flat[tokens], k, v)
    if audit is not None:
        audit.add(layer, "k_proj", tokens.numel() * n_kv * d * D)
        audit.add(layer, "v_proj", tokens.numel() * n_kv * d * D)
        audit.add(layer, "bytes_written", cache.bytes_written - written)

    # --- reads: one query row per new token -----------------------------------------------------
    out = torch.zeros(B * n, D, dtype=h.dtype, device=h.device)
    proj = _read_rows(x, cos, sin, wq, wo, batch_of[tokens], pos_flat[tokens], mode.reshape(B * n, H)[tokens], cache,
                      layer, rids, window, audit)
    return out.index_copy_(0, tokens, proj).view(B, n, D)


def _read_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, wq: torch.Tensor, wo: torch.Tensor,
               request: torch.Tensor, t: torch.Tensor, mode: torch.Tensor, cache: PagedKVCache, layer: int,
               rids: list[int], window: int, audit: CostAudit | None) -> torch.Tensor:
    """Attention of N query rows (N, D) -> (N, D): row i is a token of request `request[i]` at
    position t[i] with per-head modes mode[i] (N, H); x its normed input, cos/sin (N, 1, d) its
    rotary tables. The query and output projections of the reading (row, head) pairs only, head
    by head; one rotary embedding over all of them; every pool read by the kernels' decode
    attention for all rows and heads at once (a skipping head gets the empty range lo = t + 1);
    partials merged by log-sum-exp."""
    H, d, D = wq.shape
    N = x.shape[0]
    reading = mode != SKIP
    n_read = reading.sum(0).tolist()  # per head: reading rows
    if not any(n_read):
        return x.new_zeros(N, D)
    every = [c == N for c in n_read]
    rows = [None if c in (0, N) else reading[:, head].nonzero().flatten() for head, c in enumerate(n_read)]
    q = torch.zeros(N, H, d, dtype=x.dtype, device=x.device)  # skipping pairs stay 0 and are never read
    for head, c in enumerate(n_read):
        if every[head]:
            q[:, head] = x @ wq[head].T
        elif c:
            q[rows[head], head] = x[rows[head]] @ wq[head].T
    q = apply_rope(q, cos, sin)
    lo = read_start(t.view(-1, 1).expand_as(mode), mode, window)  # skip: t + 1, an empty range
    outs, lses = [], []
    for option, pool in enumerate(cache.layers[layer].pools):
        pages, _ = cache.page_table(layer, option, rids)  # (B, max pages) per request
        if pages.shape[1] == 0:
            continue
        step = max(1, ROW_BLOCKS // (pool.k.num_kv_heads * pages.shape[1]))  # rows per kernel call
        parts = [decode_attention_pool(q[i : i + step], pool.k, pool.v, pool.bits, cache.group_size,
                                       pages[request[i : i + step]], lo[i : i + step], t[i : i + step],
                                       1.0 / math.sqrt(d)) for i in range(0, N, step)]
        outs.append(torch.cat([o for o, _ in parts]))
        lses.append(torch.cat([lse for _, lse in parts]))
        if audit is not None:
            slots, keys = _slots_and_keys_read(pool.token_pos, pages, request, lo, t)
            audit.add(layer, "bytes_read", slots * pool.slot_bytes)
            audit.add(layer, "attn", 2 * d * keys)
    context = merge_partials(outs, lses)[0] if len(outs) > 1 else outs[0]  # (N, H, d)
    proj = torch.zeros(N, D, dtype=x.dtype, device=x.device)
    for head, c in enumerate(n_read):
        if every[head]:
            proj += context[:, head] @ wo[:, head].T
        elif c:
            proj.index_add_(0, rows[head], context[rows[head], head] @ wo[:, head].T)
    if audit is not None:
        audit.add(layer, "q_proj", sum(n_read) * d * D)
        audit.add(layer, "o_proj", sum(n_read) * d * D)
    return proj


def _slots_and_keys_read(token_pos: torch.Tensor, pages: torch.Tensor, request: torch.Tensor, lo: torch.Tensor,
                         hi: torch.Tensor) -> tuple[int, int]:
    """In one pool, with `pages` (B, max pages; absent -1) each request's page list: the slots of
    row i's request at positions <= hi[i] (its context in this pool, whatever its heads read),
    summed over rows, and the keys the (row, head) ranges [lo, hi] meet, summed over rows and
    heads; so a prefill of n tokens counts what n decode steps count. Memory O(B x positions)."""
    pos = torch.where(pages.unsqueeze(-1) >= 0, token_pos[pages.clamp(min=0)], -1).flatten(1).long()  # (B, L)
    size = max(int(hi.max()), int(pos.max())) + 2
    before = torch.zeros(pos.shape[0], size, dtype=torch.long, device=pos.device)
    before.scatter_add_(1, pos + 1, (pos >= 0).long())  # a free slot (-1) adds 0 at index 0
    before = before.cumsum(1)  # before[b, p]: b's slots at positions < p
    upto = before[request, hi + 1]  # (N,)
    keys = upto.unsqueeze(1) - before[request.unsqueeze(1), lo.clamp(max=size - 1)]  # (N, H); skip: lo = hi + 1
    return int(upto.sum()), int(keys.clamp(min=0).sum())
