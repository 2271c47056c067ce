"""Time the C++ decode ops against the PyTorch paths they replace, one decode step of one layer.

    OMP_NUM_THREADS=1 python benchmarks/bench_cpu_ops.py [--context 2048] [--batches 1 8] [--portable]
    OMP_NUM_THREADS=1 python benchmarks/bench_cpu_ops.py --baseline HEAD~1 --prefill-rows 0

Attention: the one-call C++ paged attention against the per-pool PyTorch path (one
`decode_attention_pool_torch` per width + `merge_partials`). Shape: the 160m recipe's attention (12
query heads, 3 KV heads, head dim 64, group 32), pages of 16 slots, every token's width drawn
uniformly from 2/4/8/16 bits, every head full (`--heads mixed`: each (request, head) skips, reads its
local window or reads every key with the probabilities of the 160m recipe's budget mix at this
context, `forced_decisions.budget_mix`, as `bench_decode.py` forces them). Prints per batch the median
of `--iters` calls (ms) of both paths and the C++ op's K/V bytes read (its counter) per second.

`--baseline REV`: the attention op built from `kernels/csrc/decode_ops.cpp` as of git revision REV
too (its library renamed `triroute_baseline`, built with the same flags in its own folder), called
interleaved with this tree's op on the same inputs (A B, B A, ..., `--iters` pairs: neither always runs
second): per batch the medians,
the median and quartiles of the per-call ratios (this tree / baseline) and the largest difference of
their outputs. Its `decode_linear` joins the linear rows' rounds the same way (`ratio_vs_baseline`:
quartiles of this tree / baseline; `bits_equal_baseline`: the two outputs' bits). A change to the kernel is measured against the code it replaces in one process, where
both see the same machine load.

`--bits 2` draws every token's width from the listed widths only. `--cached-pages N` also times the
attention with every request's page table pointed into its pool's first N pages, so that it reads
rows the caches hold: the same work without the memory traffic. The two run interleaved (A B, then
B A); the row adds both medians and the quartiles of the per-round ratio cached / memory (what the
rows' bytes cost the op).

`--evict-mb MB` reads MB megabytes, untimed, before every call of those interleaved comparisons: the
cache's rows then come from memory as in a decode step, where the experts' and the LM head's weights
stream through the caches between two layers' attention calls (without it, a call finds the rows the
previous one left in the third-level cache).

Prefill: the C++ attention over one request's `--prefill-rows` prompt rows at once (row t reads
positions 0..t, every head full), the call a prefill makes per layer.

Linear: `decode_linear` against `F.linear` (BLAS) at the 160m recipe's decode matmuls (a query
projection 768 x 768, an expert's first matrix 1,024 x 768, the LM head 50,304 x 768), x of `batch`
rows; each call takes the next of enough copies of the weight to fill 1 GiB (at least eight), so every
weight comes from memory as in a decode step. Interleaved (each call's order rotated every round), per shape the medians, the weight bytes read
per second by each, and the median of the per-call ratios F.linear / decode_linear.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.forced_decisions import budget_mix  # noqa: E402
from megatron_triroute.routing.modes import read_start  # noqa: E402
from megatron_triroute.training.recipes import get_recipe  # noqa: E402
from triroute_kernels import allocate_kv_pools, decode_linear, cpu_ops, quantize_pack_into_torch  # noqa: E402
from triroute_kernels.paged_ops import paged_attention, paged_attention_torch  # noqa: E402
from triroute_kernels.quant import SUPPORTED_BITS  # noqa: E402

H, H_KV, D, GROUP, PAGE = 12, 3, 64, 32, 16
WEIGHT_POOL_BYTES = 1 << 30
"""The linear rows' copies of a weight fill this much, over three times a server's last-level cache
(300 MB on the AMX Xeon of docs/kernels.md), and at least eight: no call finds its weight in a cache."""


def build_cache(batch: int, context: int, gen: torch.Generator, widths=SUPPORTED_BITS):
    """Pools of the given widths holding `context` tokens per request, each token's width drawn
    uniformly from them."""
    owner = torch.randint(0, len(widths), (batch, context), generator=gen)
    need = [[math.ceil(int((owner[b] == w).sum()) / PAGE) for b in range(batch)] for w in range(len(widths))]
    M = max(max(n) for n in need)
    tables = torch.full((len(widths), batch, M), -1, dtype=torch.long)
    k_pools, v_pools = [], []
    for w, bits in enumerate(widths):
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


def cached_tables(tables: torch.Tensor, pages: int) -> torch.Tensor:
    """`tables` with every page entry taken modulo `pages`: each request reads its pool's first
    `pages` pages over and over, so the rows come from the caches instead of memory (the keys'
    positions no longer follow each other: the work is the same, the values are not meaningful)."""
    return torch.where(tables >= 0, tables % pages, tables)


def interleaved(fn_a, fn_b, iters: int, before=None) -> tuple[float, float, list[float]]:
    """fn_a and fn_b (each called with fresh counters) `iters` rounds, A B then B A (neither always
    runs second): their median times (s) and the quartiles of the per-round ratio a / b. `before`,
    if given, runs untimed ahead of every call."""
    times_a, times_b = [], []
    pair = ((times_a, fn_a), (times_b, fn_b))
    for i in range(iters):
        for times, fn in pair[i % 2:] + pair[:i % 2]:
            counters = torch.zeros(2, dtype=torch.long)
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn(counters)
            times.append(time.perf_counter() - t0)
    ratios = [a / b for a, b in zip(times_a, times_b)]
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    return statistics.median(times_a), statistics.median(times_b), [q1, median, q3]


class Evictor:
    """Reads `mb` megabytes before a timed call: caches as cold as a decode step leaves them, where the
    experts' and the LM head's weights stream through (read, never written) between two layers'
    attention calls (0: nothing, the caches keep what the last call left)."""

    def __init__(self, mb: int):
        self.buffer = torch.ones(mb * 2**20 // 4) if mb > 0 else None

    def __call__(self) -> None:
        if self.buffer is not None:
            self.buffer.sum()


def cached_against_memory(q, pools, args, cached_args, iters: int, before=None) -> dict:
    """The attention over the cached pages (`cached_args`) and over the memory's (`args`),
    interleaved: medians and the quartiles of the per-round ratio cached / memory."""
    cached, memory, ratio = interleaved(lambda c: paged_attention(q, pools, *cached_args, c),
                                        lambda c: paged_attention(q, pools, *args, c), iters, before)
    return {"memory_ms": round(1e3 * memory, 3), "cached_ms": round(1e3 * cached, 3),
            "cached_over_memory": [round(r, 3) for r in ratio]}


def head_ranges(heads: str, batch: int, context: int, gen: torch.Generator) -> torch.Tensor:
    """lo [batch, H] for query rows at position context - 1: 0 (full) for every head, or each head's
    mode drawn from the 160m recipe's budget mix and its first key `modes.read_start`'s."""
    if heads == "full":
        return torch.zeros(batch, H, dtype=torch.long)
    config = get_recipe("160m").triroute.validate()
    mix = torch.tensor(budget_mix(config, context)["attn"])
    mode = torch.multinomial(mix, batch * H, replacement=True, generator=gen).view(batch, H)
    return read_start(torch.full((batch, H), context - 1), mode, config.router.window).long()


def median_ms(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def prefill_row(n: int, iters: int, gen: torch.Generator) -> dict:
    """The attention of one request's n prompt rows in one call (module doc)."""
    k_pools, v_pools, tables = build_cache(1, n, gen)
    q = torch.randn(n, H, D, generator=gen)
    args = (tables, torch.zeros(n, dtype=torch.long), torch.zeros(n, H, dtype=torch.long), torch.arange(n), 1 / math.sqrt(D))
    counters = torch.zeros(2, dtype=torch.long)
    ms = median_ms(lambda: paged_attention(q, (k_pools, v_pools), *args, counters), iters)
    row = {"op": "prefill_attention", "rows": n, "threads": torch.get_num_threads(), "cpp_ms": round(ms, 3)}
    print(json.dumps(row), flush=True)
    return row


LINEAR_SHAPES = {"q_proj": (768, 768), "expert_w1": (1024, 768), "lm_head": (50304, 768)}


def baseline_ops(rev: str):
    """torch.ops.triroute_baseline: the decode ops of `decode_ops.cpp` at git revision `rev` (module doc)."""
    from torch.utils.cpp_extension import load

    source = subprocess.run(["git", "show", f"{rev}:kernels/csrc/decode_ops.cpp"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout
    header = subprocess.run(["git", "show", f"{rev}:kernels/csrc/{cpu_ops.HEADER}"], cwd=REPO,  # since 6266135
                            capture_output=True, text=True)
    source = source.replace("TORCH_LIBRARY(triroute,", "TORCH_LIBRARY(triroute_baseline,")
    source = source.replace("TORCH_LIBRARY_IMPL(triroute,", "TORCH_LIBRARY_IMPL(triroute_baseline,")
    flags = cpu_ops.CFLAGS + ([] if os.environ.get("TRIROUTE_CPU_OPS_PORTABLE") else cpu_ops.NATIVE_CFLAGS)
    key = hashlib.sha256(source.encode() + header.stdout.encode() + repr(flags).encode()).hexdigest()[:16]
    where = cpu_ops.build_directory(flags).parent / f"triroute_baseline_{key}"
    where.mkdir(parents=True, exist_ok=True)
    (where / "decode_ops.cpp").write_text(source)
    if header.returncode == 0:
        (where / cpu_ops.HEADER).write_text(header.stdout)
    load(name=f"triroute_baseline_{key}", sources=[str(where / "decode_ops.cpp")], extra_cflags=flags,
         extra_ldflags=cpu_ops.LDFLAGS, build_directory=str(where), is_python_module=False, verbose=False)
    return torch.ops.triroute_baseline


def against_baseline(ops, q, k_pools, v_pools, args, iters: int, before=None) -> dict:
    """This tree's attention and the baseline's, interleaved on the same inputs (module doc)."""
    from triroute_kernels.paged_ops import _lists

    lists = _lists((k_pools, v_pools))
    op_args = (q, *lists.tensors, lists.bits, lists.group_size, *args)  # both ops called alike, no Python API
    ours_op = torch.ops.triroute.paged_attention
    diff = float((ours_op(*op_args, torch.zeros(2, dtype=torch.long))
                  - ops.paged_attention(*op_args, torch.zeros(2, dtype=torch.long))).abs().max())
    ours, base, (q1, median, q3) = interleaved(lambda c: ours_op(*op_args, c), lambda c: ops.paged_attention(*op_args, c),
                                               iters, before)
    return {"baseline_ms": round(1e3 * base, 3), "this_tree_ms": round(1e3 * ours, 3),
            "ratio_median": round(median, 3), "ratio_q1": round(q1, 3), "ratio_q3": round(q3, 3),
            "max_abs_diff_vs_baseline": diff}


def linear_rows(batch: int, iters: int, gen: torch.Generator, base=None, rev: str | None = None) -> list[dict]:
    """`decode_linear` against F.linear per shape of LINEAR_SHAPES (module doc); with `base` (the
    baseline's ops, `--baseline`) its `decode_linear` as well, in the same interleaved rounds."""
    rows = []
    for name, (N, K) in LINEAR_SHAPES.items():
        copies = max(8, WEIGHT_POOL_BYTES // (N * K * 4))
        weights = [torch.randn(N, K, generator=gen) for _ in range(copies)]
        x = torch.randn(batch, K, generator=gen)
        err = max(float((decode_linear(x, w) - F.linear(x, w)).abs().max()) for w in weights[:2])
        fns = {"decode_linear": decode_linear, "F.linear": F.linear}
        if base is not None:  # both libraries' ops called alike, without the Python API
            fns |= {"this_tree_op": torch.ops.triroute.decode_linear, "baseline": base.decode_linear}
        times = {label: [] for label in fns}
        order = list(fns.items())
        for i in range(max(iters, copies)):
            for j, (label, fn) in enumerate(order[i % len(order):] + order[:i % len(order)]):  # each follows each
                w = weights[(len(fns) * i + j) % copies]
                t0 = time.perf_counter()
                fn(x, w)
                times[label].append(time.perf_counter() - t0)
        ours, blas = (statistics.median(times[k]) for k in ("decode_linear", "F.linear"))
        rows.append({
            "op": "linear", "shape": name, "batch": batch, "n": N, "k": K, "threads": torch.get_num_threads(),
            "decode_linear_ms": round(1e3 * ours, 3), "f_linear_ms": round(1e3 * blas, 3),
            "decode_linear_gb_per_s": round(N * K * 4 / ours / 1e9, 2), "f_linear_gb_per_s": round(N * K * 4 / blas / 1e9, 2),
            "speedup": round(statistics.median(b / a for a, b in zip(times["decode_linear"], times["F.linear"])), 2),
            "max_abs_diff": err,
        })
        if base is not None:
            ratios = sorted(a / b for a, b in zip(times["this_tree_op"], times["baseline"]))
            q = statistics.quantiles(ratios, n=4)
            rows[-1] |= {"baseline": rev, "baseline_ms": round(1e3 * statistics.median(times["baseline"]), 3),
                         "ratio_vs_baseline": [round(q[0], 3), round(statistics.median(ratios), 3), round(q[2], 3)],
                         "bits_equal_baseline": bool(torch.equal(decode_linear(x, weights[0]), base.decode_linear(x, weights[0])))}
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--prefill-rows", type=int, default=512, help="prompt rows of the prefill call (0: none)")
    p.add_argument("--portable", action="store_true", help="the kernels built without -march=native (own build folder)")
    p.add_argument("--baseline", metavar="REV", help="also time the attention and linear ops of git revision REV, interleaved")
    p.add_argument("--heads", choices=("full", "mixed"), default="full",
                   help="every head full, or heads skip / local / full as the 160m budget mix draws them")
    p.add_argument("--bits", type=int, nargs="+", choices=SUPPORTED_BITS, default=list(SUPPORTED_BITS),
                   help="the cache widths each token's width is drawn from (uniformly)")
    p.add_argument("--cached-pages", type=int, default=0, metavar="N",
                   help="also time the attention over each pool's first N pages, read over and over (rows from the "
                        "caches), interleaved with the memory's pages (0: off)")
    p.add_argument("--evict-mb", type=int, default=0, metavar="MB",
                   help="before each call of the interleaved comparisons (--baseline, --cached-pages), read "
                        "MB megabytes, untimed, so the cache's rows come from memory as in a decode step (0: off)")
    a = p.parse_args()
    if a.evict_mb < 0:
        p.error(f"--evict-mb {a.evict_mb}: give a size in MB >= 1, or 0 for off")
    if a.evict_mb and not (a.baseline or a.cached_pages):
        p.error("--evict-mb applies to the interleaved comparisons only: add --baseline REV or --cached-pages N")
    if a.cached_pages < 0:
        p.error(f"--cached-pages {a.cached_pages}: give a page count >= 1, or 0 for off")
    if a.portable:
        os.environ["TRIROUTE_CPU_OPS_PORTABLE"] = "1"
    if not cpu_ops.cpu_ops_available():
        raise SystemExit(f"the C++ CPU kernels are unavailable: {cpu_ops.cpu_ops_error()}")
    gen = torch.Generator().manual_seed(0)
    base = baseline_ops(a.baseline) if a.baseline else None
    evict = Evictor(a.evict_mb)
    rows = []
    for batch in a.batches:
        k_pools, v_pools, tables = build_cache(batch, a.context, gen, a.bits)
        q = torch.randn(batch, H, D, generator=gen)
        request = torch.arange(batch)
        hi = torch.full((batch,), a.context - 1, dtype=torch.long)
        lo = head_ranges(a.heads, batch, a.context, gen)
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
            "batch": batch, "context": a.context, "heads": a.heads, "bits": a.bits, "cached_pages": a.cached_pages,
            "evict_mb": a.evict_mb, "threads": torch.get_num_threads(), "portable": a.portable,
            "cpp_ms": round(cpp, 3), "torch_per_pool_ms": round(torch_ms, 3), "speedup": round(torch_ms / cpp, 2),
            "bytes_read": int(per_call[1]), "attn_macs": int(per_call[0]), "cpp_gb_per_s": round(int(per_call[1]) / cpp / 1e6, 2),
            "max_abs_diff_vs_torch": err,
        })
        if base is not None:
            rows[-1] |= {"baseline": a.baseline} | against_baseline(base, q, k_pools, v_pools, args, a.iters, evict)
        if a.cached_pages:
            cached = (cached_tables(tables, a.cached_pages), *args[1:])
            rows[-1] |= cached_against_memory(q, (k_pools, v_pools), args, cached, a.iters, evict)
        print(json.dumps(rows[-1]), flush=True)
    if a.prefill_rows:
        rows.append(prefill_row(a.prefill_rows, a.iters, gen))
    for batch in a.batches:
        rows += linear_rows(batch, a.iters, gen, base, a.baseline)


if __name__ == "__main__":
    main()
