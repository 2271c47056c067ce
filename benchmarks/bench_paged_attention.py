"""One decode attention call over the mixed-precision pools against a dense cache's SDPA, per layer.

    python benchmarks/bench_paged_attention.py [--device cuda] [--batches 1 64] [--contexts 2048 8192]
        [--shape 160m] [--bits-mix 0.25 0.25 0.25 0.25] [--local 0.0] [--repeats 20] [--json]

What one layer's decode attention costs, isolated from the rest of the step: `paged_attention` (the op
the engine calls; on a GPU one Triton launch over every pool, on the CPU the C++ kernel) over a batch whose `context` prompt tokens are spread over the 2/4/8/16-bit pools in the exact
proportions `--bits-mix`, scattered over shuffled pages, against `scaled_dot_product_attention`
(native GQA) over a contiguous 16-bit cache [B, H_kv, T, d] (float16 on a GPU, float32 on a CPU:
the CPU has no fast half-precision SDPA). `--local` is the fraction of query heads in local-window
mode (the rest full). `--per-pool` also times the per-pool kernels merged by log-sum-exp (what
the op ran on CUDA before the all-pools Triton kernel); `--variants` the Triton kernel at other
settings of its knobs; `--graph` times CUDA-graph replays of `--inner` calls (the device's time
without the host's launch cost, as a CUDA-graphed engine would see it).

Per cell: median and interquartile range of each call's time (the two interleaved, `--repeats`
rounds of `--inner` calls; CUDA synchronised around each round), the K/V bytes each reads (the
paged op's own counter, the dense cache's size), the bandwidth those bytes imply, and that as a
fraction of a large device copy's bandwidth measured in the same run (bytes read + written).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron_triroute.training.recipes import get_recipe  # noqa: E402
from triroute_kernels import (  # noqa: E402
    SUPPORTED_BITS, PoolLists, allocate_kv_pools, decode_attention_pool, paged_attention, quantize_pack_into)
from triroute_kernels.paged_ops import paged_attention_torch  # noqa: E402

WIDTHS = SUPPORTED_BITS
PAGE = 16


def spread(values: list[float]) -> dict:
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return {"median": statistics.median(values), "q1": q1, "q3": q3}


def exact_owner(n: int, mix: list[float], gen: torch.Generator) -> torch.Tensor:
    """n pool indices in the exact proportions `mix` (largest remainders), shuffled."""
    counts = [math.floor(p * n) for p in mix]
    for i in sorted(range(len(mix)), key=lambda i: mix[i] * n - counts[i], reverse=True)[: n - sum(counts)]:
        counts[i] += 1
    owner = torch.cat([torch.full((c,), w, dtype=torch.long) for w, c in enumerate(counts)])
    return owner[torch.randperm(n, generator=gen)]


def build_pools(B: int, T: int, H_kv: int, d: int, group: int, mix: list[float], dev: torch.device, gen):
    """Pools holding B requests of positions 0..T-1 at the mix's widths, pages shuffled; page tables [W, B, M]."""
    owner = exact_owner(B * T, mix, gen).view(B, T)
    k_pools, v_pools, tables = [], [], []
    for w, bits in enumerate(WIDTHS):
        per_req = [(owner[b] == w).nonzero().flatten() for b in range(B)]
        need = [-(-len(p) // PAGE) for p in per_req]
        n_pages = max(sum(need), 1)
        kp, vp = allocate_kv_pools(bits, n_pages, PAGE, H_kv, d, group, dev)
        order = torch.randperm(n_pages, generator=gen)
        table = torch.full((B, max(max(need), 1)), -1, dtype=torch.long)
        start = 0
        slots, pos = [], []
        for b, p in enumerate(per_req):
            pages = order[start : start + need[b]]
            start += need[b]
            table[b, : need[b]] = pages
            i = torch.arange(len(p))
            slots.append(pages[i // PAGE] * PAGE + i % PAGE)
            pos.append(p)
        slots, pos = torch.cat(slots).to(dev), torch.cat(pos).to(dev)
        if slots.numel():
            for pool in (kp, vp):
                quantize_pack_into(torch.randn(slots.numel(), H_kv, d, generator=gen).to(dev), bits, group, pool, slots)
            kp.token_pos.view(-1)[slots] = pos.to(torch.int32)
        k_pools.append(kp)
        v_pools.append(vp)
        tables.append(table)
    M = max(t.shape[1] for t in tables)
    page_tables = torch.full((len(WIDTHS), B, M), -1, dtype=torch.long)
    for w, t in enumerate(tables):
        page_tables[w, :, : t.shape[1]] = t
    return PoolLists.of(k_pools, v_pools), page_tables.to(dev)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def copy_bandwidth(dev: torch.device) -> float:
    """Bytes read + written per second by a large copy, best of 5."""
    n = (1 << 28) if dev.type == "cuda" else (1 << 25)
    src, dst = torch.randn(n, device=dev), torch.empty(n, device=dev)
    best = math.inf
    for _ in range(5):
        sync(dev)
        start = time.perf_counter()
        dst.copy_(src)
        sync(dev)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best


def _eager(fn, inner: int):
    def run():
        for _ in range(inner):
            fn()
    return run


def _graphed(fn, inner: int):
    """`inner` calls of fn captured in one CUDA graph (host launch cost removed): its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    return graph.replay


def cell(shape, B: int, T: int, mix, local: float, repeats: int, inner: int, dev: torch.device, bw: float,
         per_pool_too: bool = False, variants=(), graph: bool = False) -> dict:
    m, r = shape.model, shape.router
    H, H_kv, d = m.n_heads, m.n_kv_heads, m.d_head
    group = r.group_size_for(m)
    gen = torch.Generator().manual_seed(B * 100003 + T)
    pools, tables = build_pools(B, T, H_kv, d, group, mix, dev, gen)
    q = torch.randn(B, H, d, generator=gen).to(dev)
    request = torch.arange(B, device=dev)
    hi = torch.full((B,), T - 1, dtype=torch.long, device=dev)
    is_local = torch.rand(B, H, generator=gen) < local
    lo = torch.where(is_local, max(T - 1 - r.window, 0), 0).to(dev)
    sm = 1 / math.sqrt(d)
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    k = torch.randn(B, H_kv, T, d, generator=gen).to(dev, dtype)
    v = torch.randn(B, H_kv, T, d, generator=gen).to(dev, dtype)
    qd = q.view(B, H, 1, d).to(dtype)

    def paged():
        return paged_attention(q, pools, tables, request, lo, hi, sm)

    def dense():
        return F.scaled_dot_product_attention(qd, k, v, enable_gqa=True)

    def per_pool():  # the per-pool kernels `dispatch` chooses, merged by log-sum-exp
        return paged_attention_torch(q, pools.k_pools, pools.v_pools, tables, request, lo, hi, sm,
                                     torch.zeros(2, dtype=torch.long, device=dev), decode_attention_pool)

    per_pool_too = per_pool_too and not graph  # its per-pool kernels check their inputs on the host
    contenders = {"paged": paged, "dense": dense} | ({"per_pool": per_pool} if per_pool_too else {})
    if variants:  # tuning knobs of the Triton kernel (paged_attention_triton's keyword arguments)
        from triroute_kernels.triton_paged import paged_attention_triton

        for spec in variants:
            contenders["triton_" + "_".join(f"{k}{v}" for k, v in spec.items())] = (
                lambda spec=spec: paged_attention_triton(q, pools, tables, request, lo, hi, sm,
                                                         torch.zeros(2, dtype=torch.long, device=dev), **spec))

    counters = torch.zeros(2, dtype=torch.long, device=dev)
    got = paged_attention(q, pools, tables, request, lo, hi, sm, counters)
    want = paged_attention_torch(q, pools.k_pools, pools.v_pools, tables, request, lo, hi, sm,
                                 torch.zeros(2, dtype=torch.long, device=dev))
    paged_bytes = int(counters[1])
    dense_bytes = k.nbytes + v.nbytes
    times = {name: [] for name in contenders}
    for fn in contenders.values():  # warm-up (compiles the Triton kernels)
        fn()
    runs = {name: _graphed(fn, inner) if graph else _eager(fn, inner) for name, fn in contenders.items()}
    for _ in range(repeats):
        for name, run in runs.items():
            sync(dev)
            start = time.perf_counter()
            run()
            sync(dev)
            times[name].append((time.perf_counter() - start) / inner)
    out = {"batch": B, "context": T, "local_fraction": local,
           "max_abs_diff_vs_torch_twin": float((got - want).abs().max())}
    for name, nbytes in (("paged", paged_bytes), ("dense", dense_bytes)):
        s = spread(times[name])
        out[name] = {"s": s, "kv_bytes": nbytes, "gb_s": nbytes / s["median"] / 1e9,
                     "of_copy_bw": nbytes / s["median"] / bw}
    for name in contenders:
        if name.startswith("triton_"):
            out[name] = {"s": spread(times[name]), "gb_s": paged_bytes / spread(times[name])["median"] / 1e9,
                         "max_abs_diff_vs_torch_twin": float((contenders[name]() - want).abs().max())}
    if per_pool_too:
        out["per_pool"] = {"s": spread(times["per_pool"])}
        out["per_pool_over_paged_time"] = out["per_pool"]["s"]["median"] / out["paged"]["s"]["median"]
    out["paged_over_dense_time"] = out["paged"]["s"]["median"] / out["dense"]["s"]["median"]
    out["paged_over_dense_bytes"] = paged_bytes / dense_bytes
    return out


def _spec(text: str) -> dict:
    """'pages_per_block=2,num_warps=8,dot=0,precision=ieee' -> keyword arguments."""
    out = {}
    for item in text.split(","):
        key, value = item.split("=")
        out[key] = value if key == "precision" else int(value)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", default="160m")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--bits-mix", type=float, nargs=4, default=[0.25, 0.25, 0.25, 0.25])
    p.add_argument("--local", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--inner", type=int, default=10)
    p.add_argument("--per-pool", action="store_true", help="also time the per-pool kernels merged by log-sum-exp")
    p.add_argument("--variants", type=_spec, nargs="*", default=[],
                   help="also time the Triton kernel at these settings of paged_attention_triton's knobs, each "
                        "as key=value,.. e.g. pages_per_block=2,num_warps=8,dot=0 (CUDA)")
    p.add_argument("--graph", action="store_true", help="time CUDA-graph replays (no host launch cost)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    dev = torch.device(a.device)
    shape = get_recipe(a.shape).triroute.validate()
    bw = copy_bandwidth(dev)
    rows = []
    for T in a.contexts:
        for B in a.batches:
            row = cell(shape, B, T, a.bits_mix, a.local, a.repeats, a.inner, dev, bw, a.per_pool, a.variants,
                       a.graph)
            rows.append(row)
            pg, dn = row["paged"], row["dense"]
            print(f"B={B:3d} T={T:5d}  paged {pg['s']['median'] * 1e6:9.1f} us [{pg['s']['q1'] * 1e6:.1f}-"
                  f"{pg['s']['q3'] * 1e6:.1f}] {pg['gb_s']:7.1f} GB/s ({pg['of_copy_bw']:.2f} of copy)  dense "
                  f"{dn['s']['median'] * 1e6:9.1f} us {dn['gb_s']:7.1f} GB/s ({dn['of_copy_bw']:.2f})  "
                  f"time ratio {row['paged_over_dense_time']:.2f}  bytes ratio {row['paged_over_dense_bytes']:.3f}  "
                  f"|paged - twin| {row['max_abs_diff_vs_torch_twin']:.1e}"
                  + (f"  per-pool ÷ paged {row['per_pool_over_paged_time']:.2f}" if "per_pool" in row else "")
                  + "".join(f"  {k} {v['s']['median'] * 1e6:.1f} us (|diff| {v['max_abs_diff_vs_torch_twin']:.0e})"
                          for k, v in row.items() if k.startswith("triton_")),
                  file=sys.stderr, flush=True)
    result = {"graph": a.graph, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "copy_bw_gb_s": bw / 1e9, "bits_mix": a.bits_mix, "cells": rows}
    if a.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
