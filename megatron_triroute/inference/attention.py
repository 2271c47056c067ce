"""Routed attention over the paged cache, executing only the selected reads.

Every valid token first writes its K/V to the pool of its chosen width (skip is a read
decision). Then per query head h, only the (token, h) pairs whose mode is not `skip` get a
query projection, read keys and an output projection: `local` reads keys at positions
max(0, t - w)..t, `full` 0..t. Each precision pool is read separately and the partial results
are merged by their log-sum-exp, so scratch memory is O(chunk), not O(context). Heads of one KV
group may take different modes.

Two read paths, both over the `triroute_kernels` pools:
- decode (one new token per request): `triroute_kernels.decode_attention_pool` per pool (the
  torch twin on CPU, the Triton kernel on CUDA), a skipping head given an empty key range, and
  `merge_partials` across pools;
- prompt chunks (several tokens of a request): each chunk of pages is dequantised once by the
  kernels' dequantiser and every head's reading rows whose window meets it update a running
  (max, sum, weighted V).
Work is vectorised over the batch and the reading tokens; the Python loops run over pools, page
chunks and heads, never over tokens.
"""

from __future__ import annotations

import math

import torch

from triroute_kernels import decode_attention_pool, merge_partials

from ..routing.modes import SKIP, read_start
from .audit import CostAudit
from .kv_cache import PagedKVCache

SCRATCH_ELEMENTS = 1 << 24
"""Cap on the keys gathered per chunk for one head (rows x slots x d_h floats: 64 MiB in fp32)."""


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


class _HeadReads:
    """Online-softmax state of the reading (token, head) rows of one head (the prompt-chunk path)."""

    def __init__(self, flat: torch.Tensor, q: torch.Tensor, batch: torch.Tensor, t: torch.Tensor, start: torch.Tensor):
        self.flat, self.q, self.batch, self.t, self.start = flat, q, batch, t, start
        self.m = self.l = self.acc = None  # allocated by the first chunk update (the prompt-chunk path)

    def _begin(self) -> None:
        R, d = self.q.shape
        self.m = torch.full((R,), float("-inf"), device=self.q.device)
        self.l = torch.zeros(R, device=self.q.device)
        self.acc = torch.zeros(R, d, device=self.q.device)

    def update(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, slot_ok: torch.Tensor) -> int:
        """Merge one chunk: k, v (B, N, d), pos (B, N), slot_ok (B, N). Returns keys read."""
        mask = slot_ok[self.batch] & (pos[self.batch] >= self.start[:, None]) & (pos[self.batch] <= self.t[:, None])
        rows = mask.any(1).nonzero().flatten()  # rows whose window meets this chunk
        if rows.numel() == 0:
            return 0
        if self.m is None:
            self._begin()
        mask = mask[rows]
        b = self.batch[rows]
        d = self.q.shape[1]
        scores = torch.einsum("rd,rnd->rn", self.q[rows], k[b]) / math.sqrt(d)
        scores = scores.masked_fill(~mask, float("-inf"))
        m_new = torch.maximum(self.m[rows], scores.amax(1))
        keep = torch.exp(self.m[rows] - m_new)  # exp(-inf) = 0 for a row's first chunk
        p = torch.exp(scores - m_new[:, None])
        self.l[rows] = self.l[rows] * keep + p.sum(1)
        self.acc[rows] = self.acc[rows] * keep[:, None] + torch.einsum("rn,rnd->rd", p, v[b])
        self.m[rows] = m_new
        return int(mask.sum())

    def context(self) -> torch.Tensor:
        return self.acc / self.l[:, None]


def routed_attention(h: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, wo: torch.Tensor,
                     mode: torch.Tensor, bit_option: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                     cache: PagedKVCache, layer: int, rids: list[int], window: int, audit: CostAudit | None,
                     chunk_pages: int = 64) -> torch.Tensor:
    """h (B, n, D) normed input; wq (H, d, D), wk/wv (H_kv, d, D), wo (D, H, d); mode (B, n, H)
    in ATTN_MODES order; bit_option (B, n); positions, valid (B, n). Returns (B, n, D)."""
    B, n, D = h.shape
    H, d = wq.shape[:2]
    n_kv = wk.shape[0]
    G = H // n_kv
    flat_h = h.reshape(B * n, D)
    tokens = valid.flatten().nonzero().flatten()  # (N,) valid flat indices, request-major then position
    batch_of = torch.arange(B, device=h.device).repeat_interleave(n)
    pos_flat = positions.flatten()

    # --- writes: every token, at its chosen width ---------------------------------------------
    x = flat_h[tokens]
    cos, sin = rope_tables(pos_flat, d)  # once per call: shared by K and every head's Q
    k = apply_rope(torch.einsum("nD,hdD->nhd", x, wk), cos[tokens], sin[tokens])
    v = torch.einsum("nD,hdD->nhd", x, wv)
    written = cache.bytes_written
    cache.write(layer, rids, batch_of[tokens], bit_option.flatten()[tokens], pos_flat[tokens], k, v)
    if audit is not None:
        audit.add(layer, "k_proj", tokens.numel() * n_kv * d * D)
        audit.add(layer, "v_proj", tokens.numel() * n_kv * d * D)
        audit.add(layer, "bytes_written", cache.bytes_written - written)

    modes = mode.reshape(B * n, H)
    if n == 1:
        return _decode_attention(flat_h, x, cos[tokens], sin[tokens], wq, wo, tokens, pos_flat, modes, cache, layer,
                                 rids, window, audit).view(B, n, D)

    # --- queries: only (token, head) pairs that read -------------------------------------------
    reads: list[_HeadReads | None] = []
    for head in range(H):
        flat = tokens[modes[tokens, head] != SKIP]
        if flat.numel() == 0:
            reads.append(None)
            continue
        t = pos_flat[flat]
        start = read_start(t, modes[flat, head], window)
        q = apply_rope((flat_h[flat] @ wq[head].T).unsqueeze(1), cos[flat], sin[flat]).squeeze(1)  # (R, d)
        reads.append(_HeadReads(flat, q, batch_of[flat], t, start))
        if audit is not None:
            audit.add(layer, "q_proj", flat.numel() * d * D)

    # --- reads: pool by pool, chunk by chunk, every head's rows updated per chunk -------------------
    if any(r is not None for r in reads):
        _chunk_reads(reads, cache, layer, rids, d, G, chunk_pages, audit)

    # --- output projection of the reading pairs only --------------------------------------------
    out = torch.zeros(B * n, D, dtype=h.dtype, device=h.device)
    for head, r in enumerate(reads):
        if r is not None:
            out.index_add_(0, r.flat, r.context() @ wo[:, head].T)
            if audit is not None:
                audit.add(layer, "o_proj", r.flat.numel() * d * D)
    return out.view(B, n, D)


def _chunk_reads(reads: list[_HeadReads | None], cache: PagedKVCache, layer: int, rids: list[int], d: int, G: int,
                 chunk_pages: int, audit: CostAudit | None) -> None:
    """Prompt chunks: each pool a chunk of pages at a time, dequantised once for every head's rows."""
    P = cache.page_size
    # Bound the per-chunk scratch (rows x slots x d_h gathered keys) to SCRATCH_ELEMENTS.
    rows = max(r.flat.numel() for r in reads if r is not None)
    chunk_pages = max(1, min(chunk_pages, SCRATCH_ELEMENTS // (rows * P * d)))
    for option, pool in enumerate(cache.layers[layer].pools):
        table, counts = cache.page_table(layer, option, rids)
        for c0 in range(0, table.shape[1], chunk_pages):
            K, V, pos = pool.read(table[:, c0 : c0 + chunk_pages])  # (B, C, P, H_kv, d), (B, C, P)
            K, V, pos = K.flatten(1, 2), V.flatten(1, 2), pos.flatten(1, 2)
            slot_ok = (c0 * P + torch.arange(pos.shape[1], device=pos.device)).view(1, -1) < counts.view(-1, 1)
            if audit is not None:
                audit.add(layer, "bytes_read", int(slot_ok.sum()) * pool.slot_bytes)
            for head, r in enumerate(reads):
                if r is not None:
                    keys = r.update(K[:, :, head // G], V[:, :, head // G], pos, slot_ok)
                    if audit is not None:
                        audit.add(layer, "attn", 2 * d * keys)


def _decode_attention(flat_h: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, wq: torch.Tensor,
                      wo: torch.Tensor, tokens: torch.Tensor, pos_flat: torch.Tensor, modes: torch.Tensor,
                      cache: PagedKVCache, layer: int, rids: list[int], window: int,
                      audit: CostAudit | None) -> torch.Tensor:
    """One token per request (flat index b = request b): the query and output projections of the
    reading (token, head) pairs only, head by head; one rotary embedding over all of them; every
    pool read by the kernels' decode attention for all requests and heads at once (a skipping head
    gets the empty range lo = t + 1); partials merged by log-sum-exp. x (N, D) the valid tokens'
    inputs, cos/sin (N, 1, d) their rotary tables. Returns (B, D)."""
    H, d, D = wq.shape
    N = tokens.numel()
    t = pos_flat[tokens]  # (N,)
    mode = modes[tokens]  # (N, H)
    reading = mode != SKIP
    n_read = reading.sum(0).tolist()  # per head: reading tokens
    out = torch.zeros(flat_h.shape[0], D, dtype=flat_h.dtype, device=flat_h.device)
    if not any(n_read):
        return out
    every = [c == N for c in n_read]
    rows = [None if c in (0, N) else reading[:, head].nonzero().flatten() for head, c in enumerate(n_read)]
    q = torch.zeros(N, H, d, dtype=x.dtype, device=x.device)  # skipping pairs stay 0 and are never read
    for head, c in enumerate(n_read):
        if every[head]:
            q[:, head] = x @ wq[head].T
        elif c:
            q[rows[head], head] = x[rows[head]] @ wq[head].T
    q = apply_rope(q, cos, sin)
    tt = t.view(-1, 1).expand_as(mode)
    lo = read_start(tt, mode, window)  # skip: t + 1, an empty range
    rows_rids = [rids[int(b)] for b in tokens.tolist()]
    outs, lses = [], []
    for option, pool in enumerate(cache.layers[layer].pools):
        table, counts = cache.page_table(layer, option, rows_rids)
        if table.shape[1] == 0:
            continue
        o, lse = decode_attention_pool(q, pool.k, pool.v, pool.bits, cache.group_size, table, lo, t, 1.0 / math.sqrt(d))
        outs.append(o)
        lses.append(lse)
        if audit is not None:
            audit.add(layer, "bytes_read", int(counts.sum()) * pool.slot_bytes)
            audit.add(layer, "attn", 2 * d * _keys_read(pool.token_pos, table, lo, t))
    context = merge_partials(outs, lses)[0] if len(outs) > 1 else outs[0]  # (N, H, d)
    proj = torch.zeros(N, D, dtype=flat_h.dtype, device=flat_h.device)
    for head, c in enumerate(n_read):
        if every[head]:
            proj += context[:, head] @ wo[:, head].T
        elif c:
            proj.index_add_(0, rows[head], context[rows[head], head] @ wo[:, head].T)
    if audit is not None:
        audit.add(layer, "q_proj", sum(n_read) * d * D)
        audit.add(layer, "o_proj", sum(n_read) * d * D)
    return out.index_copy_(0, tokens, proj)


def _keys_read(token_pos: torch.Tensor, table: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> int:
    """Keys a (row, head) range [lo, hi] meets in the pages of `table` (absent pages -1), summed."""
    pos = torch.where(table.unsqueeze(-1) >= 0, token_pos[table.clamp(min=0)], -1).flatten(1)  # (N, L)
    inside = (pos >= 0) & (pos <= hi.view(-1, 1))
    return int((inside.unsqueeze(1) & (pos.unsqueeze(1) >= lo.unsqueeze(-1))).sum())
