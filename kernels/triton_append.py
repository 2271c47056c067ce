"""Triton `cache_append`: a decode step's K/V write into every precision pool in one launch.

The GPU form of `paged_ops.cache_append` (same arguments): token n of decode-state row rows[n] goes
to the next slot of its pool option[n], index i = counts[option, row], on the page
tables[option, row, i // page_size]; its K and V rows are quantised there at the pool's width
(`triton_ops.quantize_row`, the cache's arithmetic bit for bit) and its position recorded in the
pool's `token_pos`. A program owns one (token, KV head); the pools' widths are compile-time
constants, so each pool's write is specialised and the token's own is taken by a branch on its
option. Nothing is read back to the host: the counts are advanced after the launch by one device
op (`index_put_`, stream-ordered behind the kernel's reads).

A token whose pool has no page reserved for that slot (or whose option names no pool) is not
written: it adds 1 to `lost`, which the cache reads with its counts and refuses (the C++ op raises
at once; on a GPU that would be a wait in every step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_ops import launch_pools, quantize_row, store_row_fp16


@triton.jit
def _write_pool(k_row, v_row, kd, ks, kz, vd, vs, vz, tp, slot, h, position, H_KV: tl.constexpr, D: tl.constexpr,
                BITS: tl.constexpr, GROUP: tl.constexpr):
    base = slot * H_KV + h
    if BITS == 16:
        store_row_fp16(k_row, kd, base, D)
        store_row_fp16(v_row, vd, base, D)
    else:
        quantize_row(k_row, kd, ks, kz, base, D, BITS, GROUP)
        quantize_row(v_row, vd, vs, vz, base, D, BITS, GROUP)
    if h == 0:
        tl.store(tp + slot, position.to(tl.int32))


@triton.jit
def _cache_append_kernel(
    k_ptr, v_ptr, option_ptr, rows_ptr, positions_ptr, counts_ptr, tables_ptr, lost_ptr,
    cs0, cs1, ts0, ts1, ts2, width,
    kd0, ks0, kz0, vd0, vs0, vz0, tp0,
    kd1, ks1, kz1, vd1, vs1, vz1, tp1,
    kd2, ks2, kz2, vd2, vs2, vz2, tp2,
    kd3, ks3, kz3, vd3, vs3, vz3, tp3,
    H_KV: tl.constexpr, D: tl.constexpr, P: tl.constexpr, GROUP: tl.constexpr, NPOOLS: tl.constexpr,
    BITS0: tl.constexpr, BITS1: tl.constexpr, BITS2: tl.constexpr, BITS3: tl.constexpr,
):
    n = tl.program_id(0)
    h = tl.program_id(1)
    option = tl.load(option_ptr + n).to(tl.int64)
    row = tl.load(rows_ptr + n).to(tl.int64)
    position = tl.load(positions_ptr + n)
    named = (option >= 0) & (option < NPOOLS)
    pool = tl.where(named, option, 0)
    count = tl.load(counts_ptr + pool * cs0 + row * cs1)
    column = count // P
    page = tl.load(tables_ptr + pool * ts0 + row * ts1 + column * ts2, mask=named & (column < width), other=-1)
    slot = page * P + count % P
    k_row = k_ptr + (n * H_KV + h) * D
    v_row = v_ptr + (n * H_KV + h) * D
    if named & (page >= 0):
        if pool == 0:
            _write_pool(k_row, v_row, kd0, ks0, kz0, vd0, vs0, vz0, tp0, slot, h, position, H_KV, D, BITS0, GROUP)
        if NPOOLS > 1:
            if pool == 1:
                _write_pool(k_row, v_row, kd1, ks1, kz1, vd1, vs1, vz1, tp1, slot, h, position, H_KV, D, BITS1, GROUP)
        if NPOOLS > 2:
            if pool == 2:
                _write_pool(k_row, v_row, kd2, ks2, kz2, vd2, vs2, vz2, tp2, slot, h, position, H_KV, D, BITS2, GROUP)
        if NPOOLS > 3:
            if pool == 3:
                _write_pool(k_row, v_row, kd3, ks3, kz3, vd3, vs3, vz3, tp3, slot, h, position, H_KV, D, BITS3, GROUP)
    elif h == 0:
        tl.atomic_add(lost_ptr, 1)


def cache_append_triton(k, v, option, rows, positions, counts, tables, page_size, pools, lost) -> None:
    """`paged_ops.cache_append` in one Triton launch (module doc); `pools` a `PoolLists`, `lost` a
    one-element int64 device tensor that counts the tokens that found no page."""
    N, H_kv, d = k.shape
    W = len(pools.bits)
    slots, bits = launch_pools(pools, d, page_size, "cache append")
    if N == 0:
        return
    dev = pools.tensors[0][0].device
    args = [t[i] for i in slots for t in pools.tensors]
    option = option.to(dev, torch.int64)
    rows = rows.to(dev, torch.int64)
    _cache_append_kernel[(N, H_kv)](
        k.detach().to(dev, torch.float32).contiguous(), v.detach().to(dev, torch.float32).contiguous(),
        option.contiguous(), rows.contiguous(), positions.to(dev, torch.int64).contiguous(), counts, tables, lost,
        counts.stride(0), counts.stride(1), tables.stride(0), tables.stride(1), tables.stride(2), tables.shape[2],
        *args, H_KV=H_kv, D=d, P=page_size, GROUP=pools.group_size, NPOOLS=W,
        BITS0=bits[0], BITS1=bits[1], BITS2=bits[2], BITS3=bits[3],
    )
    # after the kernel's reads (same stream): each token's count advances; a token of no pool adds nothing
    named = (option >= 0) & (option < W)
    counts.index_put_((option.clamp(0, W - 1), rows), named.to(counts.dtype), accumulate=True)
