"""Routed attention over the paged cache, executing only the selected reads.

Every valid token first writes its K/V to the pool of its chosen width (skip is a read
decision). Then per query head h, only the (token, h) pairs whose mode is not `skip` get a
query projection, read keys and an output projection: `local` reads keys at positions
max(0, t - w)..t, `full` 0..t. Each precision pool is read separately, a bounded chunk of pages at
a time, and the partial results are merged by an online softmax (running max, sum and weighted
V: the log-sum-exp merge), so scratch memory is O(chunk), not O(context). Heads of one KV group
may take different modes. Work is vectorised over the batch and the reading tokens; the Python
loops run over pools, page chunks and heads, never over tokens.
"""

from __future__ import annotations

import math

import torch

from ..config import ATTN_MODES
from .audit import CostAudit
from .kv_cache import PagedKVCache

SKIP, LOCAL, FULL = (ATTN_MODES.index(m) for m in ("skip", "local", "full"))
SCRATCH_ELEMENTS = 1 << 24
"""Cap on the keys gathered per chunk for one head (rows x slots x d_h floats: 64 MiB in fp32)."""


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding (Megatron's non-interleaved form): x (N, heads, d), positions (N,)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    freqs = positions.to(torch.float32).view(-1, 1) * inv_freq.view(1, -1)  # (N, d/2)
    emb = torch.cat([freqs, freqs], -1).unsqueeze(1)  # (N, 1, d)
    x1, x2 = x.chunk(2, dim=-1)
    return x * emb.cos().to(x.dtype) + torch.cat([-x2, x1], -1) * emb.sin().to(x.dtype)


class _HeadReads:
    """Online-softmax state of the reading (token, head) rows of one head."""

    def __init__(self, flat: torch.Tensor, q: torch.Tensor, batch: torch.Tensor, t: torch.Tensor, start: torch.Tensor):
        self.flat, self.q, self.batch, self.t, self.start = flat, q, batch, t, start
        R, d = q.shape
        self.m = torch.full((R,), float("-inf"))
        self.l = torch.zeros(R)
        self.acc = torch.zeros(R, d)

    def update(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, slot_ok: torch.Tensor) -> int:
        """Merge one chunk: k, v (B, N, d), pos (B, N), slot_ok (B, N). Returns keys read."""
        mask = slot_ok[self.batch] & (pos[self.batch] >= self.start[:, None]) & (pos[self.batch] <= self.t[:, None])
        rows = mask.any(1).nonzero().flatten()  # rows whose window meets this chunk
        if rows.numel() == 0:
            return 0
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
    batch_of = torch.arange(B).repeat_interleave(n)
    pos_flat = positions.flatten()

    # --- writes: every token, at its chosen width ---------------------------------------------
    x = flat_h[tokens]
    k = rope(torch.einsum("nD,hdD->nhd", x, wk), pos_flat[tokens])
    v = torch.einsum("nD,hdD->nhd", x, wv)
    written = cache.bytes_written
    cache.write(layer, rids, batch_of[tokens], bit_option.flatten()[tokens], pos_flat[tokens], k, v)
    if audit is not None:
        audit.add(layer, "k_proj", tokens.numel() * n_kv * d * D)
        audit.add(layer, "v_proj", tokens.numel() * n_kv * d * D)
        audit.add(layer, "bytes_written", cache.bytes_written - written)

    # --- queries: only (token, head) pairs that read -------------------------------------------
    modes = mode.reshape(B * n, H)
    reads: list[_HeadReads | None] = []
    for head in range(H):
        flat = tokens[modes[tokens, head] != SKIP]
        if flat.numel() == 0:
            reads.append(None)
            continue
        t = pos_flat[flat]
        start = torch.where(modes[flat, head] == LOCAL, (t - window).clamp_min(0), torch.zeros_like(t))
        q = rope((flat_h[flat] @ wq[head].T).unsqueeze(1), t).squeeze(1)  # (R, d)
        reads.append(_HeadReads(flat, q, batch_of[flat], t, start))
        if audit is not None:
            audit.add(layer, "q_proj", flat.numel() * d * D)

    # --- reads: pool by pool, a chunk of pages at a time, merged online ------------------------
    if any(r is not None for r in reads):
        P = cache.page_size
        # Bound the per-chunk scratch (rows x slots x d_h gathered keys) to SCRATCH_ELEMENTS.
        rows = max(r.flat.numel() for r in reads if r is not None)
        chunk_pages = max(1, min(chunk_pages, SCRATCH_ELEMENTS // (rows * P * d)))
        for option, pool in enumerate(cache.layers[layer].pools):
            table, counts = cache.page_table(layer, option, rids)
            for c0 in range(0, table.shape[1], chunk_pages):
                pages = table[:, c0 : c0 + chunk_pages]  # (B, C)
                K, V, pos = pool.read(pages)  # (B, C, P, H_kv, d), (B, C, P)
                K, V, pos = K.flatten(1, 2), V.flatten(1, 2), pos.flatten(1, 2)
                slot_ok = (c0 * P + torch.arange(pos.shape[1])).view(1, -1) < counts.view(-1, 1)
                if audit is not None:
                    audit.add(layer, "bytes_read", int(slot_ok.sum()) * pool.slot_bytes)
                for head, r in enumerate(reads):
                    if r is not None:
                        keys = r.update(K[:, :, head // G], V[:, :, head // G], pos, slot_ok)
                        if audit is not None:
                            audit.add(layer, "attn", 2 * d * keys)

    # --- output projection of the reading pairs only --------------------------------------------
    out = torch.zeros(B * n, D, dtype=h.dtype)
    for head, r in enumerate(reads):
        if r is not None:
            out.index_add_(0, r.flat, r.context() @ wo[:, head].T)
            if audit is not None:
                audit.add(layer, "o_proj", r.flat.numel() * d * D)
    return out.view(B, n, D)
