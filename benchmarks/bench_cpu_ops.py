"""Time the one-call C++ paged attention against the per-pool PyTorch path (one
`decode_attention_pool_torch` per width + `merge_partials`), one decode step of one layer.

    OMP_NUM_THREADS=1 python benchmarks/bench_cpu_ops.py [--context 2048] [--batches 1 8] [--portable]

Shape: the 160m recipe's attention (12 query heads, 3 KV heads, head dim 64, group 32), pages of 16
slots, every token's width drawn uniformly from 2/4/8/16 bits, every head full. Prints per batch the
median of `--iters` calls (ms) of both paths and the C++ op's K/V bytes read (its counter) per second.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import torch

from triroute_kernels import allocate_kv_pools, cpu_ops, quantize_pack_into_torch
from triroute_kernels.paged_ops import paged_attention, paged_attention_torch
from triroute_kernels.quant import SUPPORTED_BITS

H, H_KV, D, GROUP, PAGE = 12, 3, 64, 32, 16


def build_cache(batch: int, context: int, gen: torch.Generator):
    """Pools of every width holding `context` tokens per request, widths drawn per token."""
    owner = torch.randint(0, len(SUPPORTED_BITS), (batch, context), generator=gen)
    need = [[math.ceil(int((owner[b] == w).sum()) / PAGE) for b in range(batch)] for w in range(len(SUPPORTED_BITS))]
    M = max(max(n) for n in need)
    tables = torch.full((len(SUPPORTED_BITS), batch, M), -1, dtype=torch.long)
    k_pools, v_pools = [], []
    for w, bits in enumerate(SUPPORTED_BITS):
        kp, vp = allocate_kv_pools(bits, sum(need[w]), PAGE, H_KV, D, GROUP)
        first = 0
        for b in range(batch):
            pos = (owner[b] == w).nonzero().flatten()
            tables[w, b, : need[w][b]] = torch.arange(first, first + need[w][b])
            slots = first * PAGE + torch.arange(pos.numel())
            quantize_pack_into_torch(torch.randn(pos.numel(), H_KV, D, generator=gen), bits, GROUP, kp, slots)
            quantize_pack_into_torch(torch.randn(pos.numel(), H_KV, D, generator=gen), bits, GROUP, vp, slots)
            kp.token_pos.view(-1)[slots] = pos.to(torch.int32)
            first += need[w][b]
        k_pools.append(kp)
        v_pools.append(vp)
    return k_pools, v_pools, tables


def median_ms(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--portable", action="store_true", help="the kernels built without -march=native (own build folder)")
    a = p.parse_args()
    if a.portable:
        os.environ["TRIROUTE_CPU_OPS_PORTABLE"] = "1"
    if not cpu_ops.cpu_ops_available():
        raise SystemExit(f"the C++ CPU kernels are unavailable: {cpu_ops.cpu_ops_error()}")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in a.batches:
        k_pools, v_pools, tables = build_cache(batch, a.context, gen)
        q = torch.randn(batch, H, D, generator=gen)
        request = torch.arange(batch)
        lo = torch.zeros(batch, H, dtype=torch.long)
        hi = torch.full((batch,), a.context - 1, dtype=torch.long)
        sm = 1 / math.sqrt(D)
        counters = torch.zeros(2, dtype=torch.long)
        args = (tables, request, lo, hi, sm)
        out = paged_attention(q, (k_pools, v_pools), *args, counters)
        twin = paged_attention_torch(q, k_pools, v_pools, *args, torch.zeros(2, dtype=torch.long))
        err = float((out - twin).abs().max())
        cpp = median_ms(lambda: paged_attention(q, (k_pools, v_pools), *args, counters), a.iters)
        torch_ms = median_ms(lambda: paged_attention_torch(q, k_pools, v_pools, *args, torch.zeros(2, dtype=torch.long)), a.iters)
        per_call = torch.zeros(2, dtype=torch.long)
        paged_attention(q, (k_pools, v_pools), *args, per_call)
        rows.append({
            "batch": batch, "context": a.context, "threads": torch.get_num_threads(), "portable": a.portable,
            "cpp_ms": round(cpp, 3), "torch_per_pool_ms": round(torch_ms, 3), "speedup": round(torch_ms / cpp, 2),
            "bytes_read": int(per_call[1]), "attn_macs": int(per_call[0]), "cpp_gb_per_s": round(int(per_call[1]) / cpp / 1e6, 2),
            "max_abs_diff_vs_torch": err,
        })
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
