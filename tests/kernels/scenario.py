"""Shared test scenarios: requests whose tokens live in scattered pages of one or more pools,
and a naive reference attention (dequantise with routing.quant, mask, softmax) to compare with."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_triroute.routing.quant import fake_quantize
from triroute_kernels import allocate_kv_pools, quantize_pack_into_torch


@dataclass
class Stored:
    """One pool's contents, and per request the (positions, K, V) it holds (full precision)."""

    bits: int
    k_pool: object
    v_pool: object
    page_table: torch.Tensor
    tokens: list  # per request: (pos int [n], k [n, H_kv, d], v [n, H_kv, d])


def fill_pools(
    write,
    bits: int,
    lengths: list[list[int]],
    H_kv: int,
    d: int,
    g: int,
    P: int,
    gen: torch.Generator,
    spare_pages: int = 3,
) -> Stored:
    """Write the positions `lengths[b]` of each request b into shuffled pages of a fresh pool with `write`
    (a quantize_pack_into); page tables are padded with -1, and the last page of a request may be partly used."""
    need = [math.ceil(len(p) / P) for p in lengths]
    n_pages = sum(need) + spare_pages
    k_pool, v_pool = allocate_kv_pools(bits, n_pages, P, H_kv, d, g)
    order = torch.randperm(n_pages, generator=gen).tolist()
    width = max(max(need), 1) + 1  # at least one -1 column
    table = torch.full((len(lengths), width), -1, dtype=torch.int32)
    tokens = []
    for b, pos in enumerate(lengths):
        pages = [order.pop() for _ in range(need[b])]
        table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        n = len(pos)
        slots = torch.tensor([pages[i // P] * P + i % P for i in range(n)], dtype=torch.long)
        k = torch.randn(n, H_kv, d, generator=gen) * 2 + 0.5
        v = torch.randn(n, H_kv, d, generator=gen)
        if n:
            write(k, bits, g, k_pool, slots)
            write(v, bits, g, v_pool, slots)
            k_pool.token_pos.view(-1)[slots] = torch.tensor(pos, dtype=torch.int32)
        tokens.append((torch.tensor(pos, dtype=torch.long), k, v))
    return Stored(bits, k_pool, v_pool, table, tokens)


def mixed_pools(lengths: list[int], H_kv: int, P: int, gen: torch.Generator, widths, d: int, g: int):
    """Each request's positions 0..L-1 scattered over one pool per width in `widths` (in increasing
    order within each pool); returns the per-pool stores and page_tables [W, R, M] int64."""
    owner = [torch.randint(0, len(widths), (n,), generator=gen) for n in lengths]
    stores = [
        fill_pools(quantize_pack_into_torch, b, [(o == w).nonzero().flatten().tolist() for o in owner], H_kv, d, g, P, gen)
        for w, b in enumerate(widths)
    ]
    M = max(s.page_table.shape[1] for s in stores)
    tables = torch.full((len(widths), len(lengths), M), -1, dtype=torch.long)
    for w, s in enumerate(stores):
        tables[w, :, : s.page_table.shape[1]] = s.page_table.long()
    return stores, tables


def naive_attention(q, stores: list[Stored], g: int, lo, hi, sm_scale):
    """Per (b, h): dequantise every stored token of b (fake_quantize at its pool's width), keep
    lo[b, h] <= pos <= hi[b], softmax over all pools together. Returns (out, lse), 0 / -inf if empty."""
    B, H_q, d = q.shape
    H_kv = stores[0].tokens[0][1].shape[1]
    G = H_q // H_kv
    out = torch.zeros(B, H_q, d, dtype=torch.float64)
    lse = torch.full((B, H_q), -math.inf, dtype=torch.float64)
    for b in range(B):
        for h in range(H_q):
            ks, vs = [], []
            for st in stores:
                pos, k, v = st.tokens[b]
                keep = (pos >= int(lo[b, h])) & (pos <= int(hi[b]))
                if keep.any():
                    ks.append(fake_quantize(k[keep], st.bits, g)[:, h // G])
                    vs.append(fake_quantize(v[keep], st.bits, g)[:, h // G])
            if not ks:
                continue
            kk, vv = torch.cat(ks).double(), torch.cat(vs).double()
            s = kk @ q[b, h].double() * sm_scale
            lse[b, h] = torch.logsumexp(s, 0)
            out[b, h] = torch.softmax(s, 0) @ vv
    return out.float(), lse.float()
