"""Pure-PyTorch twins of the two kernels: vectorised (no per-token loops), the CPU fast path.

Writes quantise with the cache's own arithmetic (`quant.quantize_groups`, `quant.pack_codes`: the
same functions training's fake quantiser uses); reads unpack and dequantise with shifts written
out here for speed, which tests/kernels check are bit-identical to `quant.dequantize_groups` /
`quant.pack_codes` (the reference packer the tests hold is `tests/oracles.pack_kv`). The package imports nothing of `megatron_triroute`.
"""

from __future__ import annotations

import math

import torch

from .pool import PagePool, check_pool_shape
from .quant import pack_codes, quantize_groups


def _check_write(x: torch.Tensor, bits: int, group_size: int, pool: PagePool, slots: torch.Tensor) -> None:
    if x.dim() != 3:
        raise ValueError(f"x must be [N, H_kv, d_h], got shape {tuple(x.shape)}")
    if pool.bits != bits:
        raise ValueError(f"bits={bits} but the pool stores {pool.bits}-bit values")
    check_pool_shape(bits, x.shape[2], group_size)
    if bits < 16 and pool.group_size != group_size:
        raise ValueError(f"group_size={group_size} but the pool was laid out for {pool.group_size}")
    if (x.shape[1], x.shape[2]) != (pool.num_kv_heads, pool.head_dim):
        raise ValueError(f"x is [N, {x.shape[1]}, {x.shape[2]}] but the pool holds [H_kv={pool.num_kv_heads}, d_h={pool.head_dim}]")
    if slots.dim() != 1 or slots.shape[0] != x.shape[0]:
        raise ValueError(f"slots must be [N={x.shape[0]}], got shape {tuple(slots.shape)}")
    n_slots = pool.num_pages * pool.page_size
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= n_slots):
        raise ValueError(f"slots must lie in [0, {n_slots}) (num_pages * page_size), got [{int(slots.min())}, {int(slots.max())}]")


def quantize_codes(x: torch.Tensor, bits: int, group_size: int):
    """Unpacked int32 codes [..., d_h], float16 scale and zero [..., d_h // g]: the training
    quantiser's own arithmetic (quant.quantize_groups), so the cache is bit-exact with it."""
    *lead, d_h = x.shape
    codes, scale, zero = quantize_groups(x, bits, group_size)
    return codes.to(torch.int32).reshape(*lead, d_h), scale, zero


def _unpack_into(dst: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> None:
    """Write the dequantised values of uint8 `codes` [..., d_h * bits // 8] (float16 `scale`, `zero`
    [..., d_h // g]) into the float32 view `dst` [..., d_h] (any strides, last dim contiguous).

    Same arithmetic as `dequantize_groups` (code * scale, then + zero, in float32), so bit-identical;
    uint8 shifts and in-place ops keep it to a few passes over the data."""
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    split = dst.unflatten(-1, (codes.shape[-1], per_byte))
    for j in range(per_byte):
        split[..., j] = (codes >> (j * bits)) & mask if per_byte > 1 else codes
    grouped = dst.unflatten(-1, (scale.shape[-1], -1))
    grouped.mul_(scale.unsqueeze(-1)).add_(zero.unsqueeze(-1))


def unpack_dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [..., d_h * bits // 8] plus float16 [..., d_h // g] -> float32 [..., d_h] (dequantize_groups' arithmetic)."""
    out = torch.empty(*codes.shape[:-1], codes.shape[-1] * 8 // bits, dtype=torch.float32, device=codes.device)
    _unpack_into(out, codes, scale, zero, bits)
    return out


def quantize_pack_into_torch(x: torch.Tensor, bits: int, group_size: int, pool: PagePool, slots: torch.Tensor) -> None:
    """Quantise x [N, H_kv, d_h] at `bits` and write it into `pool` at flat slots (page * P + offset), in place."""
    _check_write(x, bits, group_size, pool, slots)
    idx = slots.to(device=pool.device, dtype=torch.long)
    if bits >= 16:
        flat = pool.values.view(-1, *pool.values.shape[2:])
        flat.index_copy_(0, idx, x.detach().to(torch.float16))
        return
    codes, scale, zero = quantize_codes(x.detach(), bits, group_size)
    for dst, src in ((pool.codes, pack_codes(codes, bits)), (pool.scale, scale), (pool.zero, zero)):
        dst.view(-1, *dst.shape[2:]).index_copy_(0, idx, src)


def dequantize_slots(pool: PagePool, pages: torch.Tensor) -> torch.Tensor:
    """float32 [*pages.shape, P, H_kv, d_h]: the dequantised contents of the given page ids (all >= 0)."""
    if pool.bits >= 16:
        return pool.values[pages].float()
    return unpack_dequantize(pool.codes[pages], pool.scale[pages], pool.zero[pages], pool.bits)


def _check_read(q, k_pool, v_pool, bits, page_table, lo, hi) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H_q, d_h], got shape {tuple(q.shape)}")
    B, H_q, d_h = q.shape
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if pool.bits != bits:
            raise ValueError(f"bits={bits} but {name} stores {pool.bits}-bit values")
        if pool.head_dim != d_h:
            raise ValueError(f"q has d_h={d_h} but {name} holds d_h={pool.head_dim}")
    H_kv = k_pool.num_kv_heads
    if H_q % H_kv:
        raise ValueError(f"H_q={H_q} must be a multiple of the pool's H_kv={H_kv} (GQA)")
    if page_table.dim() != 2 or page_table.shape[0] != B:
        raise ValueError(f"page_table must be [B={B}, max_pages], got shape {tuple(page_table.shape)}")
    if tuple(lo.shape) != (B, H_q):
        raise ValueError(f"lo must be [B={B}, H_q={H_q}], got shape {tuple(lo.shape)}")
    if tuple(hi.shape) != (B,):
        raise ValueError(f"hi must be [B={B}], got shape {tuple(hi.shape)}")
    if page_table.numel() and int(page_table.max()) >= k_pool.num_pages:
        raise ValueError(f"page_table holds page {int(page_table.max())} but the pool has {k_pool.num_pages} pages")


def _unpack_float(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [..., n_bytes] -> float32 [..., n_bytes * 8 // bits] codes in `pack_codes`' order (code i at bit i * bits)."""
    if bits == 8:
        return codes.float()
    mask = (1 << bits) - 1
    parts = [codes & mask] + [(codes >> j) & mask for j in range(bits, 8 - bits, bits)] + [codes >> (8 - bits)]
    return torch.stack(parts, -1).flatten(-2).float()


def _block_rows(pool: PagePool, pages: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """int64 [T * P]: the rows of blocks (page pages[e], kv head heads[e]) in the pool's flat
    [num_pages * P * H_kv, ...] views, block-major then slot."""
    P, H_kv = pool.page_size, pool.num_kv_heads
    slots = pages.view(-1, 1) * P + torch.arange(P, device=pages.device)
    return slots.mul_(H_kv).add_(heads.view(-1, 1)).flatten()


def _gather_blocks(pool: PagePool, rows: torch.Tensor) -> torch.Tensor:
    """float32 [T, P, d_h]: the dequantised (slot, kv head) rows `rows` of `_block_rows`; only these
    blocks are gathered and dequantised.

    Rows are gathered with `index_select` from flat views; codes are unpacked by scalar shifts and
    dequantised as code * scale + zero in float32 (`dequantize_groups`' arithmetic, bit-identical)."""
    P, d_h = pool.page_size, pool.head_dim
    if pool.bits >= 16:
        return pool.values.view(-1, d_h).index_select(0, rows).float().view(-1, P, d_h)
    codes = pool.codes.view(-1, pool.codes.shape[-1]).index_select(0, rows)  # [T * P, d_h * bits // 8]
    n_groups = pool.scale.shape[-1]
    scale = pool.scale.view(-1, n_groups).index_select(0, rows).float().unsqueeze(-1)
    zero = pool.zero.view(-1, n_groups).index_select(0, rows).float().unsqueeze(-1)
    values = _unpack_float(codes, pool.bits).view(rows.numel(), n_groups, -1).mul_(scale).add_(zero)
    return values.view(-1, P, d_h)


CHUNK_ELEMENTS = 1 << 22
"""Dequantised K (and V) elements gathered at once when `pages_per_chunk` is not given (16 MiB each)."""

_NO_POS = torch.iinfo(torch.int32).max


def decode_attention_pool_torch(
    q: torch.Tensor,
    k_pool: PagePool,
    v_pool: PagePool,
    bits: int,
    group_size: int,
    page_table: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    sm_scale: float,
    pages_per_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query per request over the keys of one pool; returns (out [B, H_q, d_h], lse [B, H_q]).

    (b, h) reads the slots of b's pages with lo[b, h] <= token_pos <= hi[b] from kv head
    h // (H_q // H_kv); nothing read (lo > hi: a skipping head) gives out = 0 and lse = -inf.

    Only the selected work is done. A page's largest position (from `token_pos`) decides which
    (request, kv head, page) blocks some reading query head of the group needs (a local head's
    window meets only the last pages of a pool, whose positions increase); only
    those blocks are gathered and dequantised, and only for that kv head. Their keys are scored
    for the group's query heads in one batched matmul, and keys outside a head's range (every key,
    for a skipping head of a group another head of which reads the block) are masked. A kv group
    none of whose heads reads gathers nothing, and a batch where no head reads returns at once.
    Blocks are processed `pages_per_chunk` at a time (default: about CHUNK_ELEMENTS dequantised
    values per chunk) and the chunks merged by log-sum-exp, so scratch memory is bounded by the
    chunk, not the context. Page granularity: a local head of window w gathers at most
    ceil((w + 1) / P) + 1 pages of a pool and masks the slots outside its window.
    """
    _check_read(q, k_pool, v_pool, bits, page_table, lo, hi)
    B, H_q, d_h = q.shape
    H_kv, P = k_pool.num_kv_heads, k_pool.page_size
    G = H_q // H_kv
    dev = k_pool.device
    if pages_per_chunk is None:
        pages_per_chunk = max(1, CHUNK_ELEMENTS // max(1, P * d_h))
    lo_g = lo.to(dev).reshape(B, H_kv, G).clamp_min(0)  # free slots (position -1) are never read
    hi_b = hi.to(dev).reshape(B)
    table = page_table.to(dev).long()
    if table.shape[1] == 0:
        return (torch.zeros(B, H_q, d_h, device=dev), torch.full((B, H_q), -math.inf, device=dev))
    # Per (request, page) the largest position it holds (-1: absent or empty), per (request, kv
    # head) the smallest lo of a query head of the group that reads; a block is needed iff its
    # page holds a position at or after that lo. (A page all of whose positions exceed hi is
    # gathered and masked: decode reads up to the request's newest token, so it never occurs there.)
    p_max = torch.where(table >= 0, k_pool.token_pos[table.clamp(min=0)].amax(-1), -1)  # [B, M]
    lo_read = torch.where(lo_g <= hi_b.view(B, 1, 1), lo_g, _NO_POS).amin(-1)  # [B, H_kv]
    eb, eg, em = (p_max.unsqueeze(1) >= lo_read.unsqueeze(-1)).nonzero(as_tuple=True)  # blocks read, request-major
    T = eb.numel()
    if T == 0:
        return (torch.zeros(B, H_q, d_h, device=dev), torch.full((B, H_q), -math.inf, device=dev))
    qg = q.float().to(dev).reshape(B, H_kv, G, d_h)
    m = den = acc = None  # running max, sum and weighted V per (request * kv head, query head)
    step = max(1, pages_per_chunk)
    for start in range(0, T, step):
        b, g, mm = eb[start : start + step], eg[start : start + step], em[start : start + step]
        row = b * H_kv + g  # [C] output row of each block
        pages = table[b, mm]
        ppos = k_pool.token_pos[pages].unsqueeze(1)  # [C, 1, P]; free slots (-1) fall below every lo
        drop = (ppos < lo_g[b, g].unsqueeze(-1)) | (ppos > hi_b[b].view(-1, 1, 1))  # [C, G, P]
        rows = _block_rows(k_pool, pages, g)
        s = torch.matmul(qg[b, g], _gather_blocks(k_pool, rows).transpose(-1, -2))
        s = s.mul_(sm_scale).masked_fill_(drop, -math.inf)  # [C, G, P]
        if m is None:
            m = torch.full((B * H_kv, G), -math.inf, device=dev)
        m_new = m.scatter_reduce(0, row.view(-1, 1).expand(-1, G), s.amax(-1), "amax")
        m_safe = m_new.masked_fill(m_new == -math.inf, 0.0)
        p = s.sub_(m_safe[row].unsqueeze(-1)).exp_()
        pv = torch.matmul(p, _gather_blocks(v_pool, rows))  # [C, G, d_h]
        if den is None:
            den = torch.zeros(B * H_kv, G, device=dev).index_add_(0, row, p.sum(-1))
            acc = torch.zeros(B * H_kv, G, d_h, device=dev).index_add_(0, row, pv)
        else:
            alpha = torch.exp(m - m_safe)
            den = (den * alpha).index_add_(0, row, p.sum(-1))
            acc = (acc * alpha.unsqueeze(-1)).index_add_(0, row, pv)
        m = m_new
    # A row that read nothing has den = 0, acc = 0 and m = -inf: out 0, lse -inf. A row that read
    # has den >= 1 (its largest key contributes exp(0)), which the clamp leaves unchanged.
    out = acc / den.clamp_min(1e-30).unsqueeze(-1)
    lse = m + torch.log(den)
    return out.reshape(B, H_q, d_h), lse.reshape(B, H_q)


def merge_partials(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-sum-exp merge of per-pool partials: out = sum_p exp(lse_p - lse) out_p, lse = logsumexp_p lse_p."""
    lse_all = torch.stack(lses)  # [n, B, H]
    lse = torch.logsumexp(lse_all, dim=0)
    finite = torch.isfinite(lse)
    w = torch.exp(lse_all - torch.where(finite, lse, torch.zeros_like(lse)))
    w = torch.where(finite, w, torch.zeros_like(w))
    out = (w.unsqueeze(-1) * torch.stack(outs)).sum(0)
    return out, lse
