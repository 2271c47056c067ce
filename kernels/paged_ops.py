"""The decode step's three one-call ops over all precision pools, what the engine calls:

- `paged_attention`: one query row per token over every pool with one online softmax;
- `cache_write`: every token quantised into its own width's pool;
- `routed_experts`: the top-k SwiGLU experts of each token, grouped by expert.

On CPU tensors with the C++ kernels built (`cpu_ops.cpu_ops_available()`) each is one call of
`torch.ops.triroute.*`. On CUDA attention and a decode step's append are one Triton launch over
every pool each (`triton_paged`, `triton_append`). Otherwise the twins below run pool by pool: attention by the per-pool kernel
`dispatch` chooses merged by `merge_partials`, the write by `dispatch.quantize_pack_into` per
pool, the experts by a loop. The
all-torch twins are the tests' second implementation; they may sync (they are the fallback).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from .cpu_ops import cpu_ops_available, cpu_ops_error, takes_cpu_kernel
from .dispatch import choose_backend, decode_attention_pool, quantize_pack_into
from .pool import PagePool
from .torch_ops import decode_attention_pool_torch, merge_partials, quantize_pack_into_torch

@dataclass(frozen=True)
class PoolLists:
    """One layer's pools as the ops take them: per pool (in `bits` order) the K and V payload
    tensors (a 16-bit pool's scale and zero are empty float16 tensors), the shared `token_pos`,
    the widths and the group size. Build it once (`of`) and reuse it until a pool is reallocated."""

    k_pools: tuple[PagePool, ...]
    v_pools: tuple[PagePool, ...]
    tensors: tuple[list[torch.Tensor], ...]
    """(k_data, k_scale, k_zero, v_data, v_scale, v_zero, token_pos)."""
    bits: list[int]
    group_size: int

    @classmethod
    def of(cls, k_pools: Sequence[PagePool], v_pools: Sequence[PagePool]) -> "PoolLists":
        if len(k_pools) != len(v_pools) or not k_pools:
            raise ValueError(f"k_pools and v_pools must be non-empty and of one length, got {len(k_pools)} and {len(v_pools)}")
        quantised = [p.group_size for p in k_pools if p.bits < 16]
        group_size = quantised[0] if quantised else k_pools[0].group_size
        if any(g != group_size for g in quantised):
            raise ValueError(f"every quantised pool must share one group_size, got {quantised}")
        lists: list[list[torch.Tensor]] = [[] for _ in range(7)]
        for kp, vp in zip(k_pools, v_pools):
            if kp.bits != vp.bits:
                raise ValueError(f"a K pool of {kp.bits} bits is paired with a V pool of {vp.bits} bits")
            for off, pool in ((0, kp), (3, vp)):
                if pool.bits >= 16:
                    lists[off] += [pool.values]
                    lists[off + 1] += [pool.values.new_empty(0)]
                    lists[off + 2] += [pool.values.new_empty(0)]
                else:
                    lists[off] += [pool.codes]
                    lists[off + 1] += [pool.scale]
                    lists[off + 2] += [pool.zero]
            lists[6].append(kp.token_pos)
        return cls(tuple(k_pools), tuple(v_pools), tuple(lists), [p.bits for p in k_pools], group_size)


def _lists(pools) -> PoolLists:
    """`pools`: a PoolLists, or a (k_pools, v_pools) pair."""
    return pools if isinstance(pools, PoolLists) else PoolLists.of(*pools)


_WARNED: list = []


def _use_cpp(*tensors: torch.Tensor) -> bool:
    """CPU tensors and the C++ kernels built; on the CPU without them, one warning per process."""
    if not all(t.device.type == "cpu" for t in tensors):
        return False
    if cpu_ops_available():
        return True
    if not _WARNED:
        _WARNED.append(True)
        warnings.warn(f"the C++ CPU decode kernels are unavailable, decoding with the slower PyTorch twins: "
                      f"{cpu_ops_error()}", RuntimeWarning, stacklevel=3)
    return False


# --- attention ----------------------------------------------------------------------------------
def paged_attention(
    q: torch.Tensor,
    pools: PoolLists | tuple[Sequence[PagePool], Sequence[PagePool]],
    page_tables: torch.Tensor,
    request: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    sm_scale: float,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of query rows q [N, H, d] (float32) over all pools (`pools`: a `PoolLists`, or
    (k_pools, v_pools)): row n, head h reads the slots of
    row request[n] of `page_tables` [W, R, M] (per pool, page ids, -1 = none) whose positions lie in
    lo[n, h]..hi[n] (lo [N, H], hi [N], int64), from kv head h // (H / H_kv); one softmax over every
    pool. A head reading nothing gets 0. `counters` (int64 [2]), if given, is incremented by the
    executed attention MACs (2 d per query head and key scored) and the K/V bytes read (codes +
    scale + zero, or float16 values, of each (slot, kv head) row dequantised)."""
    if counters is None:
        counters = torch.zeros(2, dtype=torch.long, device=q.device)
    p = _lists(pools)
    if _use_cpp(q, page_tables):
        return torch.ops.triroute.paged_attention(
            q, *p.tensors, p.bits, p.group_size, page_tables, request, lo, hi, float(sm_scale), counters
        )
    if choose_backend(q.device) == "triton":  # CUDA: every pool in one Triton launch
        from .triton_paged import paged_attention_triton

        return paged_attention_triton(q, p, page_tables, request, lo, hi, sm_scale, counters)
    # Elsewhere, pool by pool (the per-pool kernel `dispatch` chooses) and merged.
    return paged_attention_torch(q, p.k_pools, p.v_pools, page_tables, request, lo, hi, sm_scale, counters,
                                 decode_attention_pool)


def paged_attention_torch(q, k_pools, v_pools, page_tables, request, lo, hi, sm_scale, counters,
                          pool_attention=decode_attention_pool_torch) -> torch.Tensor:
    """The PyTorch twin: per pool `decode_attention_pool_torch`, then `merge_partials`; the
    counters from the positions the kernel reads (same definition)."""
    gs = PoolLists.of(k_pools, v_pools).group_size
    N, H, d = q.shape
    H_kv = k_pools[0].num_kv_heads
    G = H // H_kv
    lo_c = lo.long().clamp_min(0)
    hi_c = hi.long()
    outs, lses = [], []
    macs = torch.zeros((), dtype=torch.long, device=q.device)
    nbytes = torch.zeros((), dtype=torch.long, device=q.device)
    for w, (kp, vp) in enumerate(zip(k_pools, v_pools)):
        table = page_tables[w].index_select(0, request.long())  # [N, M]
        out, lse = pool_attention(q.float(), kp, vp, kp.bits, gs, table, lo_c, hi_c, sm_scale)
        outs.append(out)
        lses.append(lse)
        pos = torch.where((table >= 0).unsqueeze(-1), kp.token_pos[table.clamp_min(0)].long(), -1).flatten(1)  # [N, M*P]
        in_hi = pos <= hi_c.view(N, 1)
        took = (pos.unsqueeze(1) >= lo_c.unsqueeze(-1)) & in_hi.unsqueeze(1) & (lo_c <= hi_c.view(N, 1)).unsqueeze(-1)  # [N, H, S]
        macs += 2 * d * took.sum()
        row_read = took.view(N, H_kv, G, -1).any(2)  # a (slot, kv head) row is dequantised once for its group
        nbytes += row_read.sum() * (kp.bytes_per_slot() + vp.bytes_per_slot()) // H_kv
    counters += torch.stack([macs, nbytes])
    return merge_partials(outs, lses)[0]


# --- cache write --------------------------------------------------------------------------------
def cache_write(
    k: torch.Tensor,
    v: torch.Tensor,
    option: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    pools: PoolLists | tuple[Sequence[PagePool], Sequence[PagePool]],
) -> None:
    """Quantise token n's k[n], v[n] ([N, H_kv, d]) into pool option[n] (< 0: skip the token) at flat
    slot slots[n] (page * P + offset in that pool) and record positions[n] in its token_pos."""
    p = _lists(pools)
    if _use_cpp(k, option):
        torch.ops.triroute.cache_write(
            k.float(), v.float(), option.long(), slots.long(), positions.long(), *p.tensors, p.bits, p.group_size
        )
        return
    cache_write_torch(k, v, option, slots, positions, p.k_pools, p.v_pools, quantize_pack_into)


def cache_append(
    k: torch.Tensor,
    v: torch.Tensor,
    option: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    counts: torch.Tensor,
    tables: torch.Tensor,
    page_size: int,
    pools: PoolLists | tuple[Sequence[PagePool], Sequence[PagePool]],
    lost: torch.Tensor | None = None,
) -> None:
    """A decode step's write, one token per request (`rows` distinct): token n of decode-state row
    rows[n] goes to the next slot of its pool option[n], index i = counts[option, row] on the page
    tables[option, row, i // page_size], as `cache_write` writes it; counts[option, row] += 1.
    counts [pools, R], tables [pools, R, width] int64 (a page reserved for every such slot).

    A token with no page reserved: the C++ op raises, writing nothing; the twin raises. The Triton op
    (CUDA), which reads nothing back, writes the other tokens and adds the lost ones to `lost` (a
    one-element int64 tensor on the pools' device, required there) for the caller to check when it
    next reads the device."""
    p = _lists(pools)
    if _use_cpp(k, option):
        torch.ops.triroute.cache_append(k.float(), v.float(), option.long(), rows.long(), positions.long(), counts,
                                        tables, page_size, *p.tensors, p.bits, p.group_size)
        return
    if choose_backend(counts.device) == "triton":
        if lost is None:
            raise ValueError("cache_append on the Triton backend needs `lost` (a one-element int64 tensor on the "
                             "pools' device) to count the tokens that found no page")
        from .triton_append import cache_append_triton

        cache_append_triton(k, v, option, rows, positions, counts, tables, page_size, p, lost)
        return
    index = counts[option, rows]
    counts.index_put_((option, rows), torch.ones((), dtype=counts.dtype, device=counts.device), accumulate=True)
    page = tables[option, rows, index // page_size]
    cache_write(k, v, option, page * page_size + index % page_size, positions, p)


def cache_write_torch(k, v, option, slots, positions, k_pools, v_pools, pool_write=quantize_pack_into_torch) -> None:
    """The PyTorch twin: per pool, `quantize_pack_into_torch` of the tokens that chose it."""
    for w, (kp, vp) in enumerate(zip(k_pools, v_pools)):
        sel = (option == w).nonzero().flatten()
        if sel.numel() == 0:
            continue
        at = slots.long().index_select(0, sel)
        pool_write(k.index_select(0, sel).float(), kp.bits, kp.group_size, kp, at)
        pool_write(v.index_select(0, sel).float(), vp.bits, vp.group_size, vp, at)
        kp.token_pos.view(-1)[at] = positions.index_select(0, sel).to(torch.int32)


# --- linear ------------------------------------------------------------------------------------
DECODE_LINEAR_ROWS = 16
"""Up to this many rows of x, `decode_linear` takes the C++ kernel on the CPU (kernels/csrc)."""


def few_rows(x: torch.Tensor) -> bool:
    """Whether x [M, K] is a decode step's few float32 rows on a CPU where the C++ kernels are built
    (and not being compiled): what the fused decode-layer ops (`csrc/layer_ops.cpp`) take."""
    return x.dim() == 2 and 0 < x.shape[0] <= DECODE_LINEAR_ROWS and takes_cpu_kernel(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm over the last dimension with `weight`, up to rounding (the order of the sum); a
    decode step's few float32 rows on the CPU in one C++ call (`torch.ops.triroute.rms_norm`)
    instead of PyTorch's six ops."""
    rows = x.reshape(-1, x.shape[-1])
    if few_rows(rows) and weight.dtype == torch.float32:
        return torch.ops.triroute.rms_norm(rows.contiguous(), weight.contiguous(), eps).view(x.shape)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def decode_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w.T for w [N, K] (an nn.Linear weight), equal to F.linear(x, w) up to rounding
    (the order of the sum). On the CPU with the C++ kernels, float32 x of at most
    `DECODE_LINEAR_ROWS` rows (a decode step's tokens) reads w once at one thread's streaming rate:
    eight rows of w in flight, each block of them applied to every row of x from the first-level
    cache (BLAS's gemv and small-M gemm read it at a half to two thirds of that here,
    benchmarks/bench_cpu_ops.py). Other shapes, devices and dtypes go to F.linear."""
    if x.dim() == 2 and x.shape[0] <= DECODE_LINEAR_ROWS and x.dtype == torch.float32 and _use_cpp(x, w):
        return torch.ops.triroute.decode_linear(x, w)
    return F.linear(x, w)


# --- experts ------------------------------------------------------------------------------------
def routed_experts(
    x: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor,
    w1: Sequence[torch.Tensor],
    w3: Sequence[torch.Tensor],
    w2: Sequence[torch.Tensor],
) -> torch.Tensor:
    """sum_j weight[n, j] * w2_e(silu(w1_e x_n) * w3_e x_n), e = index[n, j] (-1: the null expert,
    nothing); x [N, D], index/weight [N, k], w1/w3 per expert [F, D], w2 [D, F] (nn.Linear weights),
    each a sequence of the experts' weights or one tensor stacking them ([E, F, D], [E, D, F]).

    On the CPU the C++ op; on the Triton backend (CUDA) `routed_experts_static`, which reads nothing
    back (give it stacked weights: lists are stacked at every call); otherwise the loop twin."""
    if _use_cpp(x, index):
        return torch.ops.triroute.routed_experts(x, index.long(), weight, list(w1), list(w3), list(w2))
    if choose_backend(x.device) == "triton":
        return routed_experts_static(x, index, weight, *(w if torch.is_tensor(w) else torch.stack(list(w))
                                                         for w in (w1, w3, w2)))
    return routed_experts_torch(x, index, weight, w1, w3, w2)


def routed_experts_static(x, index, weight, w1, w3, w2) -> torch.Tensor:
    """`routed_experts` with stacked weights (w1/w3 [E, F, D], w2 [E, D, F]), shapes fixed by N, k
    and E alone and no value read back (a GPU's form: no wait, and a CUDA graph can hold it).
    At most E routes (N k <= E: a decode step's few tokens): each route's expert weights gathered
    by index, so only the routed experts are read. More: every expert over every token and the
    gates as a dense (N, E) matrix, so each expert's weights are read once (E / k times the
    routed FLOPs, which a few tokens' decode step can spend), its outputs for tokens not routed to it
    left out (a non-finite value there adds nothing, as in the other forms)."""
    N, k = index.shape
    E = w1.shape[0]
    index = index.long()
    real = index >= 0  # (N, k): not the null expert
    expert = index.clamp_min(0)  # a null route reads expert 0, weighted 0 and left out
    gate = torch.where(real, weight.to(x.dtype), 0)  # (N, k)
    if N * k <= E:
        e = expert.reshape(-1)  # (N k,)
        xr = x.repeat_interleave(k, 0).unsqueeze(-1)  # (N k, D, 1)
        h = F.silu(torch.bmm(w1[e], xr)) * torch.bmm(w3[e], xr)  # (N k, F, 1)
        y = torch.bmm(w2[e], h).view(N, k, -1) * gate.unsqueeze(-1)  # (N, k, D)
        return torch.where(real.unsqueeze(-1), y, 0).sum(1)  # a null route adds nothing
    # a null route shares expert 0's column with a real one: counted, not scattered (which one lands is undefined)
    routed = torch.zeros(N, E, dtype=torch.int32, device=x.device).scatter_add_(1, expert, real.int()) > 0
    dense = torch.zeros(N, E, dtype=x.dtype, device=x.device).scatter_add_(1, expert, gate)  # (N, E)
    h = F.silu(torch.matmul(x, w1.transpose(1, 2))) * torch.matmul(x, w3.transpose(1, 2))  # (E, N, F)
    y = torch.matmul(h, w2.transpose(1, 2)) * dense.T.unsqueeze(-1)  # (E, N, D)
    return torch.where(routed.T.unsqueeze(-1), y, 0).sum(0)  # an expert a token does not route to adds nothing


def routed_experts_torch(x, index, weight, w1, w3, w2) -> torch.Tensor:
    """The PyTorch twin: each expert on the tokens routed to it."""
    out = torch.zeros_like(x)
    for e in range(len(w1)):
        rows, slot = (index == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        xe = x[rows]
        y = F.linear(F.silu(F.linear(xe, w1[e])) * F.linear(xe, w3[e]), w2[e])
        out.index_add_(0, rows, y * weight[rows, slot].to(x.dtype).unsqueeze(1))
    return out
