"""Triton `paged_attention`: one launch over every precision pool, one online softmax.

The GPU form of `paged_ops.paged_attention` (same arguments, same counters). A program owns one
(query row, KV head, split): it loads the KV head's G query heads once, walks the split's share of
the row's pages in every pool, PAGES_PER_BLOCK table entries per iteration (the pools' widths are
compile-time constants, so each pool's unpack is specialised), dequantises each page's K and V rows
once for all G heads, and carries one (max, sum, accumulator) per head across pools. Pages whose
slots all lie outside every head's range [lo, hi] are not read past their positions. Each pool's
loop ends at the row's last page in that pool (`used_entries`), so a pool a row barely uses costs it
barely anything. Splits of the page list (split-K, so a small batch still fills the GPU) are merged
by log-sum-exp. Executed attention MACs and K/V bytes are added to `counters` by the programs
themselves (atomics), with the twin's definition: 2 d per (query head, key scored); a (slot, KV
head) row's K+V bytes once per group that loads it (with `early`, the slots of a loaded page past
the row's last position too: more bytes than the twin's count, which the counter then says).

Layout constraints as `triton_ops.check_triton_layout` (powers of two), at most
`triton_ops.MAX_POOLS` pools.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_ops import _load_kv, launch_pools
from .torch_ops import merge_partials

PAGES_PER_BLOCK = 4
"""Page-table entries one loop iteration reads together (PAGES_PER_BLOCK * page_size slots)."""
PROGRAMS_PER_SM = 8
"""Split-K aims for this many (row, KV head, split) programs per multiprocessor."""
DOT = True
"""Scores and the weighted sum of values as `tl.dot` over the group's query heads (padded to 16
rows), in PRECISION, where both of its reductions are long enough (`dot_fits`); False: broadcast
products reduced per head."""
MIN_DOT_K = 16
"""The shortest reduction `tl.dot` compiles (head dim for the scores, slots per block for P.V)."""
PRECISION = "tf32x3"
"""tl.dot's input precision: tf32x3 keeps float32 accuracy on the tensor cores."""
SKIP_UNREAD = False
"""Branch over blocks no head of the group reads (False: masked loads only, a loop without branches)."""
CODES = False
"""Scores and P.V in the codes' domain (`_block_codes`: scale and zero applied per group after two tf32
products on the exact codes, no dequantised tile), where the groups allow (`codes_fits`)."""
EARLY = False
"""Where every head of a group reads from position 0, load K and V masked by the page, beside the
positions (False: after them, masked by the slots some head reads)."""
PACKED = True
"""Unpack each row's code bytes in registers, one scale and zero per group (False: per-channel gathers)."""
NUM_WARPS = 4
"""Warps per program (2 and 8 measured slower on an H200 at batch 64 x 8,192: docs/gpu.md)."""


def _splits(rows: int, max_pages: int, device: torch.device, pages_per_block: int) -> int:
    """Splits of the page list so that rows * splits fills the device, each split keeping at
    least one block of pages."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    want = -(-PROGRAMS_PER_SM * sms // max(1, rows))
    return max(1, min(want, max_pages // pages_per_block))


@triton.jit
def _load_codes(data, scale, zero, slot, hkv, valid,
                S: tl.constexpr, H_KV: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr):
    """[S, D] float32 codes (exact in tf32), [S, NG] float32 scale and zero of KV head `hkv` at `slot`;
    16-bit: the float16 values (exact in tf32), scale 1 and zero 0. Rows not `valid` read 0."""
    NG: tl.constexpr = D // GROUP
    row = slot * H_KV + hkv  # [S]
    m = valid[:, None]
    g_idx = tl.arange(0, NG)
    if BITS == 16:
        code = tl.load(data + row[:, None] * D + tl.arange(0, D)[None, :], mask=m, other=0.0).to(tl.float32)
        sc = tl.full([S, NG], 1.0, tl.float32)
        zp = tl.zeros([S, NG], tl.float32)
    else:
        PER: tl.constexpr = 8 // BITS
        NB: tl.constexpr = D * BITS // 8
        byte = tl.load(data + row[:, None] * NB + tl.arange(0, NB)[None, :], mask=m, other=0).to(tl.int32)
        shift = tl.arange(0, PER) * BITS
        code = (byte[:, :, None] >> shift[None, None, :]) & ((1 << BITS) - 1)  # [S, NB, PER]: channel byte*PER+j
        code = tl.reshape(code, (S, D)).to(tl.float32)
        sc = tl.load(scale + row[:, None] * NG + g_idx[None, :], mask=m, other=0.0).to(tl.float32)
        zp = tl.load(zero + row[:, None] * NG + g_idx[None, :], mask=m, other=0.0).to(tl.float32)
    return code, sc, zp


@triton.jit
def _load_rows(data, scale, zero, slot, hkv, valid,
               S: tl.constexpr, H_KV: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
               PACKED: tl.constexpr):
    """Dequantised [S, D] float32 of KV head `hkv` at the slots `slot` (rows not `valid` read 0).
    PACKED: each row's code bytes and its per-group scale and zero are loaded once and unpacked
    in registers; else every channel gathers its own byte, scale and zero (`triton_ops._load_kv`)."""
    d_idx = tl.arange(0, D)
    if BITS == 16 or not PACKED:
        out = _load_kv(data, scale, zero, data, slot, hkv, d_idx, valid, H_KV, D, BITS, GROUP)
    else:
        NG: tl.constexpr = D // GROUP
        code, sc, zp = _load_codes(data, scale, zero, slot, hkv, valid, S, H_KV, D, BITS, GROUP)  # sc, zp [S, NG]
        sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (S, NG, GROUP)), (S, D))
        zp = tl.reshape(tl.broadcast_to(zp[:, :, None], (S, NG, GROUP)), (S, D))
        out = code * sc + zp
    return out


@triton.jit
def _split_tf32(x):
    """x = hi + lo with hi exact in tf32 (its low 13 mantissa bits cleared); lo carries the rest, so two
    tf32 products against a tf32-exact operand give float32 accuracy."""
    hi = (x.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return hi, x - hi


@triton.jit
def _halves(x, R: tl.constexpr, D: tl.constexpr, NG: tl.constexpr):
    """An [R, D] tile as its two quantisation groups' [R, D // 2] tiles (NG 2); NG 1: x itself twice."""
    if NG == 1:
        a = x
        b = x
    else:
        a, b = tl.split(tl.permute(tl.reshape(x, (R, 2, D // 2)), (0, 2, 1)))
    return a, b


@triton.jit
def _cols(x, S: tl.constexpr, NG: tl.constexpr):
    """An [S, NG] tile's columns as [S] vectors (NG 1: the one column twice)."""
    if NG == 1:
        a = tl.reshape(x, (S,))
        b = a
    else:
        a, b = tl.split(x)
    return a, b


@triton.jit
def _dot2(a_hi, a_lo, b):
    """a @ b in float32 accuracy where b is exact in tf32: two tf32 products."""
    return tl.dot(a_hi, b, input_precision="tf32") + tl.dot(a_lo, b, input_precision="tf32")


@triton.jit
def _block_codes(m_i, l_i, acc, macs, nbytes, qa_hi, qa_lo, qb_hi, qb_lo, qsum_a, qsum_b, lo_h, hi, sm_scale, tp,
                 in_hi, any_head, rows, n_read, slot, data_k, scale_k, zero_k, data_v, scale_v, zero_v, row_bytes, hkv,
                 GP: tl.constexpr, S: tl.constexpr, H_KV: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                 GROUP: tl.constexpr):
    """`_block` in the codes' domain: a key's dequantised value per group is code * scale + zero, so
    q.k = sum over groups of scale * (q_g . code_g) + zero * sum(q_g), and P.V per group is
    (P * scale) . code + P . zero. The codes (and 16-bit values) are exact in tf32, so each product
    is two tf32 passes (the other operand split, `_split_tf32`) and no [S, D] dequantised tile exists.
    Groups: NG = D // GROUP of 1 or 2."""
    NG: tl.constexpr = D // GROUP
    valid = in_hi[None, :] & (tp[None, :] >= lo_h[:, None])  # [GP, S]
    ck, sck, zpk = _load_codes(data_k, scale_k, zero_k, slot, hkv, rows, S, H_KV, D, BITS, GROUP)
    cka, ckb = _halves(ck, S, D, NG)
    ska, skb = _cols(sck, S, NG)
    zka, zkb = _cols(zpk, S, NG)
    s = _dot2(qa_hi, qa_lo, tl.trans(cka)) * ska[None, :] + qsum_a[:, None] * zka[None, :]
    if NG == 2:
        s += _dot2(qb_hi, qb_lo, tl.trans(ckb)) * skb[None, :] + qsum_b[:, None] * zkb[None, :]
    s = tl.where(valid, s * sm_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a head with nothing read yet
    alpha = tl.exp(m_i - m_use)
    p = tl.exp(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    cv, scv, zpv = _load_codes(data_v, scale_v, zero_v, slot, hkv, rows, S, H_KV, D, BITS, GROUP)
    cv = tl.where(any_head[:, None], cv, 0.0)  # a slot no head reads adds nothing, whatever its payload
    scv = tl.where(any_head[:, None], scv, 0.0)
    zpv = tl.where(any_head[:, None], zpv, 0.0)
    cva, cvb = _halves(cv, S, D, NG)
    sva, svb = _cols(scv, S, NG)
    zva, zvb = _cols(zpv, S, NG)
    pa_hi, pa_lo = _split_tf32(p * sva[None, :])
    out_a = _dot2(pa_hi, pa_lo, cva) + tl.sum(p * zva[None, :], axis=1)[:, None]  # [GP, GROUP]
    if NG == 2:
        pb_hi, pb_lo = _split_tf32(p * svb[None, :])
        out_b = _dot2(pb_hi, pb_lo, cvb) + tl.sum(p * zvb[None, :], axis=1)[:, None]
        out = tl.reshape(tl.permute(tl.join(out_a, out_b), (0, 2, 1)), (GP, D))
    else:
        out = out_a
    acc = acc * alpha[:, None] + out
    macs += tl.sum(tl.sum(valid.to(tl.int64), axis=1), axis=0) * (2 * D)
    nbytes += n_read.to(tl.int64) * row_bytes
    return m_new, l_i, acc, macs, nbytes


@triton.jit
def _block(m_i, l_i, acc, macs, nbytes, q, lo_h, hi, sm_scale, tp, in_hi, any_head, rows, n_read, slot,
           data_k, scale_k, zero_k, data_v, scale_v, zero_v, row_bytes, hkv,
           S: tl.constexpr, H_KV: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
           DOT: tl.constexpr, PREC: tl.constexpr, PACKED: tl.constexpr, ZERO_V: tl.constexpr):
    """One block of slots into the group's online softmax (state: max, sum, accumulator per head).
    K and V are loaded at the slots `rows` (`any_head`, or a superset of it: then ZERO_V zeroes V's rows
    outside `any_head`, so a slot that no head reads adds nothing even where its payload is not finite)."""
    valid = in_hi[None, :] & (tp[None, :] >= lo_h[:, None])  # [GP, S]
    k = _load_rows(data_k, scale_k, zero_k, slot, hkv, rows, S, H_KV, D, BITS, GROUP, PACKED)
    if DOT:
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * sm_scale
    else:
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * sm_scale
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a head with nothing read yet
    alpha = tl.exp(m_i - m_use)
    p = tl.exp(s - m_use[:, None])
    v = _load_rows(data_v, scale_v, zero_v, slot, hkv, rows, S, H_KV, D, BITS, GROUP, PACKED)
    if ZERO_V:
        v = tl.where(any_head[:, None], v, 0.0)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PREC)
    else:
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    macs += tl.sum(tl.sum(valid.to(tl.int64), axis=1), axis=0) * (2 * D)
    nbytes += n_read.to(tl.int64) * row_bytes
    return m_new, l_i, acc, macs, nbytes


@triton.jit
def _any_block(m_i, l_i, acc, macs, nbytes, q, qs, lo_h, hi, sm_scale, tp, in_hi, any_head, rows, n_read, slot,
               data_k, scale_k, zero_k, data_v, scale_v, zero_v, row_bytes, hkv,
               S: tl.constexpr, H_KV: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
               DOT: tl.constexpr, PREC: tl.constexpr, PACKED: tl.constexpr, CODES: tl.constexpr, GP: tl.constexpr,
               BY_PAGE: tl.constexpr):
    """`_block_codes` (CODES; `qs` the split query) or `_block`."""
    if CODES:
        qa_hi, qa_lo, qb_hi, qb_lo, qsum_a, qsum_b = qs
        m_i, l_i, acc, macs, nbytes = _block_codes(
            m_i, l_i, acc, macs, nbytes, qa_hi, qa_lo, qb_hi, qb_lo, qsum_a, qsum_b, lo_h, hi, sm_scale, tp, in_hi,
            any_head, rows, n_read, slot, data_k, scale_k, zero_k, data_v, scale_v, zero_v, row_bytes, hkv, GP, S,
            H_KV, D, BITS, GROUP)
    else:
        m_i, l_i, acc, macs, nbytes = _block(
            m_i, l_i, acc, macs, nbytes, q, lo_h, hi, sm_scale, tp, in_hi, any_head, rows, n_read, slot, data_k,
            scale_k, zero_k, data_v, scale_v, zero_v, row_bytes, hkv, S, H_KV, D, BITS, GROUP, DOT, PREC, PACKED,
            BY_PAGE)
    return m_i, l_i, acc, macs, nbytes


@triton.jit
def _pool_loop(m_i, l_i, acc, macs, nbytes, q, qs, lo_h, lo_min, hi, sm_scale,
               data_k, scale_k, zero_k, data_v, scale_v, zero_v, pos_ptr, table_ptr, first, last, row_bytes, hkv,
               H_KV: tl.constexpr, D: tl.constexpr, P: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
               PB: tl.constexpr, DOT: tl.constexpr, SKIP: tl.constexpr, PREC: tl.constexpr, PACKED: tl.constexpr,
               BY_PAGE: tl.constexpr, CODES: tl.constexpr, GP: tl.constexpr):
    """The table entries [first, last) of one pool, PB entries (PB * P slots) per iteration. BY_PAGE:
    K and V are loaded masked by the page alone, beside the positions (two dependent loads, not three:
    for a group whose heads all read from position 0, where the positions rule out only slots past
    the row's last one); else masked by the slots some head reads."""
    j = tl.arange(0, PB * P)  # the slots of PB consecutive table entries, read as one block
    for i in range(first, last, PB):
        entry = i + j // P
        page = tl.load(table_ptr + entry, mask=entry < last, other=-1).to(tl.int64)
        slot = page * P + j % P
        tp = tl.load(pos_ptr + slot, mask=page >= 0, other=-1)
        in_hi = (tp >= 0) & (tp <= hi)
        any_head = in_hi & (tp >= lo_min)  # the slots some head of the group reads
        n_any = tl.sum(any_head.to(tl.int32), axis=0)
        if BY_PAGE:
            rows = page >= 0
            n_read = tl.sum(rows.to(tl.int32), axis=0)  # the slots whose K/V bytes are loaded
        else:
            rows = any_head
            n_read = n_any
        if SKIP:  # a block no head reads is skipped past its positions
            if n_any > 0:
                m_i, l_i, acc, macs, nbytes = _any_block(m_i, l_i, acc, macs, nbytes, q, qs, lo_h, hi, sm_scale, tp,
                                                         in_hi, any_head, rows, n_read, slot, data_k, scale_k, zero_k,
                                                         data_v, scale_v, zero_v, row_bytes, hkv, PB * P, H_KV, D,
                                                         BITS, GROUP, DOT, PREC, PACKED, CODES, GP, BY_PAGE)
        else:  # masked loads: the bytes of a block no head reads are not fetched either
            m_i, l_i, acc, macs, nbytes = _any_block(m_i, l_i, acc, macs, nbytes, q, qs, lo_h, hi, sm_scale, tp,
                                                     in_hi, any_head, rows, n_read, slot, data_k, scale_k, zero_k,
                                                     data_v, scale_v, zero_v, row_bytes, hkv, PB * P, H_KV, D,
                                                     BITS, GROUP, DOT, PREC, PACKED, CODES, GP, BY_PAGE)
    return m_i, l_i, acc, macs, nbytes


@triton.jit
def _pool_pass(m_i, l_i, acc, macs, nbytes, q, qs, lo_h, lo_min, hi, sm_scale,
               data_k, scale_k, zero_k, data_v, scale_v, zero_v, pos_ptr, table_ptr, first, last, row_bytes, hkv,
               H_KV: tl.constexpr, D: tl.constexpr, P: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
               PB: tl.constexpr, DOT: tl.constexpr, SKIP: tl.constexpr, PREC: tl.constexpr, PACKED: tl.constexpr,
               EARLY: tl.constexpr, CODES: tl.constexpr, GP: tl.constexpr):
    """One pool's entries [first, last) into the group's softmax state (`_pool_loop`); EARLY: its
    loads masked by the page where every head of the group reads from position 0."""
    if EARLY:
        if lo_min == 0:
            m_i, l_i, acc, macs, nbytes = _pool_loop(
                m_i, l_i, acc, macs, nbytes, q, qs, lo_h, lo_min, hi, sm_scale, data_k, scale_k, zero_k, data_v,
                scale_v, zero_v, pos_ptr, table_ptr, first, last, row_bytes, hkv, H_KV, D, P, BITS, GROUP, PB, DOT,
                SKIP, PREC, PACKED, True, CODES, GP)
        else:
            m_i, l_i, acc, macs, nbytes = _pool_loop(
                m_i, l_i, acc, macs, nbytes, q, qs, lo_h, lo_min, hi, sm_scale, data_k, scale_k, zero_k, data_v,
                scale_v, zero_v, pos_ptr, table_ptr, first, last, row_bytes, hkv, H_KV, D, P, BITS, GROUP, PB, DOT,
                SKIP, PREC, PACKED, False, CODES, GP)
    else:
        m_i, l_i, acc, macs, nbytes = _pool_loop(
            m_i, l_i, acc, macs, nbytes, q, qs, lo_h, lo_min, hi, sm_scale, data_k, scale_k, zero_k, data_v, scale_v,
            zero_v, pos_ptr, table_ptr, first, last, row_bytes, hkv, H_KV, D, P, BITS, GROUP, PB, DOT, SKIP, PREC,
            PACKED, False, CODES, GP)
    return m_i, l_i, acc, macs, nbytes


@triton.jit
def _paged_attention_kernel(
    q_ptr, lo_ptr, hi_ptr, request_ptr, table_ptr, used_ptr, out_ptr, lse_ptr, counters_ptr,
    R, M, pages_per_split, sm_scale,
    dk0, sk0, zk0, dv0, sv0, zv0, pos0, rb0,
    dk1, sk1, zk1, dv1, sv1, zv1, pos1, rb1,
    dk2, sk2, zk2, dv2, sv2, zv2, pos2, rb2,
    dk3, sk3, zk3, dv3, sv3, zv3, pos3, rb3,
    H_Q: tl.constexpr, H_KV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
    GROUP: tl.constexpr, NPOOLS: tl.constexpr, PB: tl.constexpr, DOT: tl.constexpr, SKIP: tl.constexpr,
    PREC: tl.constexpr, PACKED: tl.constexpr, EARLY: tl.constexpr, CODES: tl.constexpr,
    BITS0: tl.constexpr, BITS1: tl.constexpr, BITS2: tl.constexpr, BITS3: tl.constexpr,
):
    n = tl.program_id(0)
    hkv = tl.program_id(1)
    split = tl.program_id(2)
    N = tl.num_programs(0)
    g_idx = tl.arange(0, GP)
    d_idx = tl.arange(0, D)
    head = hkv * G + g_idx
    real = g_idx < G
    hi = tl.load(hi_ptr + n)
    lo_h = tl.load(lo_ptr + n * H_Q + head, mask=real, other=0)
    lo_h = tl.where(real, tl.maximum(lo_h, 0), hi + 1)  # padding heads read nothing
    lo_min = tl.min(lo_h, axis=0)
    q = tl.load(q_ptr + (n * H_Q + head[:, None]) * D + d_idx[None, :], mask=real[:, None], other=0.0).to(tl.float32)
    r = tl.load(request_ptr + n).to(tl.int64)
    first = split * pages_per_split
    last = tl.minimum(first + pages_per_split, M)
    last = tl.where(lo_min <= hi, last, first)  # a group whose heads all skip reads nothing
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    macs = tl.sum(tl.zeros([GP], tl.int64), axis=0)
    nbytes = tl.sum(tl.zeros([GP], tl.int64), axis=0)
    if CODES:  # the query per quantisation group, split for two tf32 products, and its sums
        qa, qb = _halves(q, GP, D, D // GROUP)
        qa_hi, qa_lo = _split_tf32(qa)
        qb_hi, qb_lo = _split_tf32(qb)
        qs = (qa_hi, qa_lo, qb_hi, qb_lo, tl.sum(qa, axis=1), tl.sum(qb, axis=1))
    else:
        qs = q  # not read
    row = table_ptr + r * M
    pool_stride = R * M
    used = used_ptr + r  # per pool: the row's table entries up to its last page (a loop's end)
    if NPOOLS > 0:
        m_i, l_i, acc, macs, nbytes = _pool_pass(
            m_i, l_i, acc, macs, nbytes, q, qs, lo_h, lo_min, hi, sm_scale, dk0, sk0, zk0, dv0, sv0, zv0, pos0,
            row, first, tl.minimum(last, tl.load(used)), rb0, hkv,
            H_KV, D, P, BITS0, GROUP, PB, DOT, SKIP, PREC, PACKED, EARLY, CODES, GP)
    if NPOOLS > 1:
        m_i, l_i, acc, macs, nbytes = _pool_pass(
            m_i, l_i, acc, macs, nbytes, q, qs, lo_h, lo_min, hi, sm_scale, dk1, sk1, zk1, dv1, sv1, zv1, pos1,
            row + pool_stride, first, tl.minimum(last, tl.load(used + R)), rb1, hkv,
            H_KV, D, P, BITS1, GROUP, PB, DOT, SKIP, PREC, PACKED, EARLY, CODES, GP)
    if NPOOLS > 2:
        m_i, l_i, acc, macs, nbytes = _pool_pass(
            m_i, l_i, acc, macs, nbytes, q, qs, lo_h, lo_min, hi, sm_scale, dk2, sk2, zk2, dv2, sv2, zv2, pos2,
            row + 2 * pool_stride, first, tl.minimum(last, tl.load(used + 2 * R)), rb2, hkv,
            H_KV, D, P, BITS2, GROUP, PB, DOT, SKIP, PREC, PACKED, EARLY, CODES, GP)
    if NPOOLS > 3:
        m_i, l_i, acc, macs, nbytes = _pool_pass(
            m_i, l_i, acc, macs, nbytes, q, qs, lo_h, lo_min, hi, sm_scale, dk3, sk3, zk3, dv3, sv3, zv3, pos3,
            row + 3 * pool_stride, first, tl.minimum(last, tl.load(used + 3 * R)), rb3, hkv,
            H_KV, D, P, BITS3, GROUP, PB, DOT, SKIP, PREC, PACKED, EARLY, CODES, GP)
    read = l_i > 0.0
    den = tl.where(read, l_i, 1.0)
    at = (split * N + n) * H_Q + head
    tl.store(out_ptr + at[:, None] * D + d_idx[None, :], tl.where(read[:, None], acc / den[:, None], 0.0),
             mask=real[:, None])
    tl.store(lse_ptr + at, tl.where(read, m_i + tl.log(den), float("-inf")), mask=real)
    tl.atomic_add(counters_ptr, macs)
    tl.atomic_add(counters_ptr + 1, nbytes)


def used_entries(page_tables: torch.Tensor) -> torch.Tensor:
    """(W, R, M) page tables -> (W, R) int32: each row's entries up to and including its last page
    (-1 entries after it are never visited; a -1 before it is skipped by the masks). Device ops
    only, no read back."""
    entries = torch.arange(1, page_tables.shape[-1] + 1, dtype=torch.int32, device=page_tables.device)
    return torch.where(page_tables >= 0, entries, 0).amax(-1).contiguous()


def dot_fits(d: int, slots_per_block: int) -> bool:
    """Whether `tl.dot` can take both products: q.K^T reduces over d, P.V over a block's slots."""
    return min(d, slots_per_block) >= MIN_DOT_K


def codes_fits(d: int, group_size: int, slots_per_block: int, device: torch.device) -> bool:
    """Whether the codes-domain block (`CODES`) takes this layout: one or two quantisation groups per
    head, and on a GPU `tl.dot`'s reductions (a group's channels, a block's slots) of at least 16."""
    if d // group_size not in (1, 2):
        return False
    return device.type != "cuda" or min(group_size, slots_per_block) >= MIN_DOT_K


def paged_attention_triton(q, pools, page_tables, request, lo, hi, sm_scale, counters, num_splits=None,
                           pages_per_block=PAGES_PER_BLOCK, num_warps=NUM_WARPS, num_stages=None, dot=DOT,
                           skip=SKIP_UNREAD, precision=PRECISION, packed=PACKED, early=EARLY, maxnreg=None,
                           codes=CODES):
    """`paged_ops.paged_attention` in one Triton launch (module doc); `pools` a `PoolLists`.
    The keyword arguments are tuning knobs (defaults: the module constants)."""
    N, H, d = q.shape
    kp0 = pools.k_pools[0]
    H_kv, P, W = kp0.num_kv_heads, kp0.page_size, len(pools.bits)
    slots, bits = launch_pools(pools, d, P, "paged attention")
    dot = dot and dot_fits(d, pages_per_block * P)
    codes = codes and codes_fits(d, pools.group_size, pages_per_block * P, q.device)
    if H % H_kv:
        raise ValueError(f"{H} query heads do not share {H_kv} KV heads evenly")
    G = H // H_kv
    _, R, M = page_tables.shape
    dev = q.device
    splits = num_splits or _splits(N * H_kv, M, dev, pages_per_block)
    per_split = max(1, -(-M // splits))
    splits = max(1, -(-M // per_split))
    out = torch.empty(splits, N, H, d, dtype=torch.float32, device=dev)
    lse = torch.empty(splits, N, H, dtype=torch.float32, device=dev)
    if N == 0:
        return out.sum(0)
    k_data, k_scale, k_zero, v_data, v_scale, v_zero, token_pos = pools.tensors
    used = used_entries(page_tables)
    args = []
    for i in slots:
        row_bytes = (pools.k_pools[i].bytes_per_slot() + pools.v_pools[i].bytes_per_slot()) // H_kv
        args += [k_data[i], k_scale[i], k_zero[i], v_data[i], v_scale[i], v_zero[i], token_pos[i], row_bytes]
    _paged_attention_kernel[(N, H_kv, splits)](
        q.float().contiguous(), lo.long().contiguous(), hi.long().contiguous(), request.long().contiguous(),
        page_tables.long().contiguous(), used, out, lse, counters,
        R, M, per_split, float(sm_scale), *args,
        H_Q=H, H_KV=H_kv, G=G, GP=max(16 if dot or codes else 1, triton.next_power_of_2(G)), D=d, P=P, GROUP=pools.group_size, NPOOLS=W,
        PB=pages_per_block, DOT=dot, SKIP=skip, PREC=precision, PACKED=packed, EARLY=early, CODES=codes, num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}), **({} if maxnreg is None else {"maxnreg": maxnreg}),
        BITS0=bits[0], BITS1=bits[1], BITS2=bits[2], BITS3=bits[3],
    )
    if splits == 1:
        return out[0]
    return merge_partials(list(out.unbind(0)), list(lse.unbind(0)))[0]
