"""Triton kernels: quantise-and-pack K/V into page slots, and decode attention over one pool.

Same contract and layout as the torch twins in `torch_ops` (see `pool`). They run on CUDA
tensors, or on CPU tensors when TRITON_INTERPRET=1 was set before triton was imported.
Layout constraints of these kernels: head_dim and group_size powers of two, group_size a
multiple of the codes per byte (8 // bits), page_size a power of two.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .pool import PagePool
from .torch_ops import _check_read, _check_write, merge_partials


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_triton_layout(bits: int, head_dim: int, group_size: int, page_size: int) -> None:
    """Raise a ValueError naming the field when the Triton kernels cannot handle this layout."""
    if not _pow2(head_dim):
        raise ValueError(f"the Triton kernels need a power-of-two head_dim, got {head_dim}; use the torch backend")
    if not _pow2(page_size):
        raise ValueError(f"the Triton kernels need a power-of-two page_size, got {page_size}")
    if bits < 16 and (not _pow2(group_size) or group_size % (8 // bits)):
        raise ValueError(
            f"the Triton kernels need a power-of-two group_size that is a multiple of {8 // bits} at {bits} bits, got {group_size}"
        )


MAX_POOLS = 4
"""Pools the all-pools kernels (`triton_paged`, `triton_append`) take in one launch."""


def launch_pools(pools, head_dim: int, page_size: int, what: str) -> tuple[list[int], list[int]]:
    """For an all-pools kernel and `pools` (a `PoolLists`): the pool each of its MAX_POOLS argument
    slots takes (slots past the last pool repeat it; the kernel's NPOOLS leaves them unused) and
    those pools' widths. Raises a ValueError naming `what` where the pools do not fit the kernels
    (more than MAX_POOLS, or a layout `check_triton_layout` refuses)."""
    W = len(pools.bits)
    if W > MAX_POOLS:
        raise ValueError(f"the Triton {what} takes at most {MAX_POOLS} pools, got {W}")
    for b in pools.bits:
        check_triton_layout(b, head_dim, pools.group_size, page_size)
    slots = [min(w, W - 1) for w in range(MAX_POOLS)]
    return slots, [pools.bits[i] for i in slots]


@triton.jit
def _round_half_even(y):
    """torch.round (round half to even) on fp32 values of magnitude < 2**23."""
    f = tl.floor(y)
    diff = y - f  # exact
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    up = (diff > 0.5) | ((diff == 0.5) & odd)
    return tl.where(up, f + 1.0, f)


@triton.jit
def group_scale_zero(lo, hi, LEVELS: tl.constexpr):
    """The cache's float16 scale and zero of groups with range [lo, hi] at 2^b - 1 = LEVELS:
    half((hi - lo) / LEVELS), a true division, and half(lo)."""
    return tl.div_rn(hi - lo, LEVELS * 1.0).to(tl.float16), lo.to(tl.float16)


@triton.jit
def group_codes(x, s, z, LEVELS: tl.constexpr):
    """float32 codes of x with the float32 values of its group's scale s and zero z (broadcast to
    x): clamp(round_half_even((x - z) / s), 0, LEVELS), dividing by 1 where s is 0."""
    codes = _round_half_even(tl.div_rn(x - z, tl.where(s > 0.0, s, 1.0)))
    return tl.minimum(tl.maximum(codes, 0.0), LEVELS * 1.0)


@triton.jit
def quantize_row(x_row, codes_ptr, scale_ptr, zero_ptr, base, D: tl.constexpr, BITS: tl.constexpr,
                 GROUP: tl.constexpr):
    """Quantise one (token, kv head) row of D float32 values at `x_row` into row `base` (slot *
    H_kv + head) of a pool's codes, scale and zero: the cache's arithmetic, bit for bit."""
    PER: tl.constexpr = 8 // BITS  # codes per byte
    NG: tl.constexpr = D // GROUP  # groups per head
    BPG: tl.constexpr = GROUP // PER  # bytes per group
    NBYTES: tl.constexpr = D * BITS // 8
    LEVELS: tl.constexpr = (1 << BITS) - 1
    g_idx = tl.arange(0, NG)
    b_idx = tl.arange(0, BPG)
    j_idx = tl.arange(0, PER)
    # channel c = g * GROUP + byte * PER + j: [NG, BPG, PER]
    chan = g_idx[:, None, None] * GROUP + b_idx[None, :, None] * PER + j_idx[None, None, :]
    x = tl.load(x_row + chan).to(tl.float32)
    lo = tl.min(tl.min(x, axis=2), axis=1)  # [NG]
    hi = tl.max(tl.max(x, axis=2), axis=1)
    scale16, zero16 = group_scale_zero(lo, hi, LEVELS)
    s = scale16.to(tl.float32)[:, None, None]
    codes = group_codes(x, s, zero16.to(tl.float32)[:, None, None], LEVELS)
    codes = tl.where(s > 0.0, codes, 0.0).to(tl.int32)  # a constant group stores code 0
    packed = tl.sum(codes << (j_idx[None, None, :] * BITS), axis=2)  # [NG, BPG]
    tl.store(codes_ptr + base * NBYTES + g_idx[:, None] * BPG + b_idx[None, :], packed.to(tl.uint8))
    tl.store(scale_ptr + base * NG + g_idx, scale16)
    tl.store(zero_ptr + base * NG + g_idx, zero16)


@triton.jit
def store_row_fp16(x_row, values_ptr, base, D: tl.constexpr):
    """One row of D values at `x_row` into row `base` of a 16-bit pool."""
    d = tl.arange(0, D)
    tl.store(values_ptr + base * D + d, tl.load(x_row + d).to(tl.float16))


@triton.jit
def _quantize_pack_kernel(
    x_ptr, slots_ptr, codes_ptr, scale_ptr, zero_ptr,
    H_KV: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
):
    n = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    quantize_row(x_ptr + (n * H_KV + h) * D, codes_ptr, scale_ptr, zero_ptr, slot * H_KV + h, D, BITS, GROUP)


@triton.jit
def _store_fp16_kernel(x_ptr, slots_ptr, values_ptr, H_KV: tl.constexpr, D: tl.constexpr):
    n = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    store_row_fp16(x_ptr + (n * H_KV + h) * D, values_ptr, slot * H_KV + h, D)


def quantize_pack_into_triton(x: torch.Tensor, bits: int, group_size: int, pool: PagePool, slots: torch.Tensor) -> None:
    """Triton twin of `torch_ops.quantize_pack_into_torch`."""
    _check_write(x, bits, group_size, pool, slots)
    N, H_kv, d = x.shape
    check_triton_layout(bits, d, group_size, pool.page_size)
    if N == 0:
        return
    xc = x.detach().to(device=pool.device, dtype=torch.float32).contiguous()
    sl = slots.to(device=pool.device, dtype=torch.int64).contiguous()
    if bits >= 16:
        _store_fp16_kernel[(N, H_kv)](xc, sl, pool.values, H_KV=H_kv, D=d)
        return
    _quantize_pack_kernel[(N, H_kv)](xc, sl, pool.codes, pool.scale, pool.zero, H_KV=H_kv, D=d, BITS=bits, GROUP=group_size)


@triton.jit
def _load_kv(codes_ptr, scale_ptr, zero_ptr, values_ptr, slot, hkv, d_idx, valid,
             H_KV: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr):
    """Dequantised [P, D] float32 of kv head `hkv` at the page slots `slot` (rows not `valid` read 0)."""
    m = valid[:, None]
    if BITS == 16:
        return tl.load(values_ptr + (slot[:, None] * H_KV + hkv) * D + d_idx[None, :], mask=m, other=0.0).to(tl.float32)
    PER: tl.constexpr = 8 // BITS
    NG: tl.constexpr = D // GROUP
    NBYTES: tl.constexpr = D * BITS // 8
    row = slot[:, None] * H_KV + hkv
    byte = tl.load(codes_ptr + row * NBYTES + d_idx[None, :] // PER, mask=m, other=0).to(tl.int32)
    code = (byte >> ((d_idx[None, :] % PER) * BITS)) & ((1 << BITS) - 1)
    sc = tl.load(scale_ptr + row * NG + d_idx[None, :] // GROUP, mask=m, other=0.0).to(tl.float32)
    zp = tl.load(zero_ptr + row * NG + d_idx[None, :] // GROUP, mask=m, other=0.0).to(tl.float32)
    return code.to(tl.float32) * sc + zp


@triton.jit
def _decode_attention_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, kv_ptr, vc_ptr, vs_ptr, vz_ptr, vv_ptr,
    pos_ptr, table_ptr, lo_ptr, hi_ptr, out_ptr, lse_ptr,
    max_pages, pages_per_split, sm_scale,
    H_Q: tl.constexpr, H_KV: tl.constexpr, D: tl.constexpr, P: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)  # this program reads pages [split * pages_per_split, (split + 1) * pages_per_split)
    B = tl.num_programs(0)
    hkv = h // (H_Q // H_KV)
    d_idx = tl.arange(0, D)
    p_idx = tl.arange(0, P)
    lo = tl.load(lo_ptr + b * H_Q + h)
    hi = tl.load(hi_ptr + b)
    q = tl.load(q_ptr + (b * H_Q + h) * D + d_idx).to(tl.float32)
    m_i = tl.max(tl.full([P], float("-inf"), tl.float32), axis=0)
    l_i = tl.sum(tl.zeros([P], tl.float32), axis=0)
    acc = tl.zeros([D], tl.float32)
    first = split * pages_per_split
    last = tl.minimum(first + pages_per_split, max_pages)
    last = tl.where(lo <= hi, last, first)  # a skipped head reads nothing
    for i in range(first, last):
        page = tl.load(table_ptr + b * max_pages + i).to(tl.int64)
        if page >= 0:
            tp = tl.load(pos_ptr + page * P + p_idx)
            valid = (tp >= 0) & (tp >= lo) & (tp <= hi)
            if tl.sum(valid.to(tl.int32), axis=0) > 0:
                slot = page * P + p_idx
                k = _load_kv(kc_ptr, ks_ptr, kz_ptr, kv_ptr, slot, hkv, d_idx, valid, H_KV, D, BITS, GROUP)
                s = tl.sum(k * q[None, :], axis=1) * sm_scale
                s = tl.where(valid, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=0))
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(s - m_new)
                v = _load_kv(vc_ptr, vs_ptr, vz_ptr, vv_ptr, slot, hkv, d_idx, valid, H_KV, D, BITS, GROUP)
                l_i = l_i * alpha + tl.sum(p, axis=0)
                acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
                m_i = m_new
    read = l_i > 0.0
    den = tl.where(read, l_i, 1.0)
    row = (split * B + b) * H_Q + h  # partials [splits, B, H_Q, ...]
    tl.store(out_ptr + row * D + d_idx, tl.where(read, acc / den, 0.0))
    tl.store(lse_ptr + row, tl.where(read, m_i + tl.log(den), float("-inf")))


def _pool_ptrs(pool: PagePool):
    if pool.bits >= 16:
        return pool.values, pool.values, pool.values, pool.values  # only the last is read
    return pool.codes, pool.scale, pool.zero, pool.codes  # the last is never read


def decode_attention_pool_triton(
    q: torch.Tensor,
    k_pool: PagePool,
    v_pool: PagePool,
    bits: int,
    group_size: int,
    page_table: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    sm_scale: float,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `torch_ops.decode_attention_pool_torch`.

    The page list is cut into `num_splits` contiguous parts read by separate programs (split-K,
    so a short batch still fills the GPU; default `default_splits`), whose partial (out, lse) are
    merged by log-sum-exp."""
    _check_read(q, k_pool, v_pool, bits, page_table, lo, hi)
    B, H_q, d = q.shape
    check_triton_layout(bits, d, group_size, k_pool.page_size)
    dev = k_pool.device
    max_pages = page_table.shape[1]
    if B == 0 or max_pages == 0:
        return (torch.zeros(B, H_q, d, dtype=torch.float32, device=dev),
                torch.full((B, H_q), -math.inf, dtype=torch.float32, device=dev))
    splits = num_splits or default_splits(B * H_q, max_pages)
    if splits < 1:
        raise ValueError(f"num_splits={splits} must be >= 1")
    per_split = -(-max_pages // splits)
    splits = -(-max_pages // per_split)
    out = torch.empty(splits, B, H_q, d, dtype=torch.float32, device=dev)
    lse = torch.empty(splits, B, H_q, dtype=torch.float32, device=dev)
    table = page_table.to(device=dev, dtype=torch.int32).contiguous()
    _decode_attention_kernel[(B, H_q, splits)](
        q.to(device=dev, dtype=torch.float32).contiguous(),
        *_pool_ptrs(k_pool),
        *_pool_ptrs(v_pool),
        k_pool.token_pos,
        table,
        lo.to(device=dev, dtype=torch.int32).contiguous(),
        hi.to(device=dev, dtype=torch.int32).contiguous(),
        out,
        lse,
        max_pages,
        per_split,
        float(sm_scale),
        H_Q=H_q,
        H_KV=k_pool.num_kv_heads,
        D=d,
        P=k_pool.page_size,
        BITS=bits,
        GROUP=group_size,
    )
    if splits == 1:
        return out[0], lse[0]
    return merge_partials(list(out.unbind(0)), list(lse.unbind(0)))


TARGET_PROGRAMS = 512
"""Programs the split-K default aims for (a few per SM of a current GPU)."""
MIN_PAGES_PER_SPLIT = 4


def default_splits(rows: int, max_pages: int) -> int:
    """Splits of the page list so that rows * splits reaches TARGET_PROGRAMS, each split keeping
    at least MIN_PAGES_PER_SPLIT pages."""
    want = max(1, TARGET_PROGRAMS // max(1, rows))
    return max(1, min(want, max_pages // MIN_PAGES_PER_SPLIT))
