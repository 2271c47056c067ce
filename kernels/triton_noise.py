"""The routing noise's counter hash as one Triton launch: `counter_uniform_triton`, the same bits as
the C++ kernel (`csrc/noise_ops.cpp`) and as the tensor chain that defines them
(`megatron_triroute/routing/noise.py`), on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1).

    u[a, b, t, c] = ((h >> 8) + 0.5) / 2^24,   h = mix(mix(mix(prefix[a] ^ sample[b]) ^ position[b, t]) ^ counter[c])

and the chain words of one key field, `chain_words_triton` (the per-token words that hash reads):

    word[i] = (mix((key[i] mod 2^32) ^ (0x9E3779B9 (field + 1) mod 2^32)) * 0x85EBCA6B) mod 2^32

The 32-bit words are held in uint64 lanes; each product of two words is exact there (below 2^64)
and is taken modulo 2^32 with a mask, as the chain does with its 16-bit halves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mix32(x):
    """lowbias32 on 32-bit values in uint64 lanes."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _counter_uniform_kernel(prefix_ptr, sample_ptr, position_ptr, counter_ptr, out_ptr, R, B, T, n, position_rows,
                            BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # flat (a, b, t)
    live = rows < R
    a = rows // (B * T)
    b = (rows // T) % B
    t = rows % T
    p = tl.load(prefix_ptr + a, mask=live, other=0).to(tl.uint64)
    s = tl.load(sample_ptr + b, mask=live, other=0).to(tl.uint64)
    w = tl.load(position_ptr + tl.where(position_rows == 1, 0, b) * T + t, mask=live, other=0).to(tl.uint64)
    h = _mix32(_mix32(p ^ s) ^ w)
    cols = tl.arange(0, BLOCK_N)
    has = cols < n
    c = tl.load(counter_ptr + cols, mask=has, other=0).to(tl.uint64)
    h = _mix32(h[:, None] ^ c[None, :])
    u = ((h >> 8).to(tl.float64) + 0.5) / 16777216.0
    tl.store(out_ptr + rows[:, None] * n + cols[None, :], u, mask=live[:, None] & has[None, :])


def counter_uniform_triton(prefix: torch.Tensor, sample_words: torch.Tensor, position_words: torch.Tensor,
                           counters: torch.Tensor) -> torch.Tensor:
    """float64 (A, B, T, n) from prefix (A,), sample_words (B,), position_words (B or 1, T) and
    counters (n,), all int64 32-bit words."""
    A, B, (rows_p, T), n = prefix.shape[0], sample_words.shape[0], position_words.shape, counters.shape[0]
    if rows_p not in (1, B):
        raise ValueError(f"position_words has {rows_p} rows; give 1 or B={B}")
    out = torch.empty(A, B, T, n, dtype=torch.float64, device=prefix.device)
    R = A * B * T
    block_r = 64
    _counter_uniform_kernel[(triton.cdiv(R, block_r),)](
        prefix.contiguous(), sample_words.contiguous(), position_words.contiguous(), counters.contiguous(), out,
        R, B, T, n, rows_p, BLOCK_R=block_r, BLOCK_N=triton.next_power_of_2(max(n, 1)))
    return out


@triton.jit
def _chain_words_kernel(key_ptr, out_ptr, N, salt, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < N
    k = tl.load(key_ptr + i, mask=live, other=0).to(tl.uint64) & 0xFFFFFFFF
    w = (_mix32(k ^ salt) * 0x85EBCA6B) & 0xFFFFFFFF
    tl.store(out_ptr + i, w.to(tl.int64), mask=live)


def chain_words_triton(keys: torch.Tensor, field: int) -> torch.Tensor:
    """int64 words of `keys`' shape: the chain word of key field `field` for each int64 key."""
    keys = keys.contiguous()
    out = torch.empty_like(keys)
    n, block = keys.numel(), 1024
    if n:
        _chain_words_kernel[(triton.cdiv(n, block),)](keys, out, n, (0x9E3779B9 * (field + 1)) & 0xFFFFFFFF,
                                                      BLOCK=block)
    return out
