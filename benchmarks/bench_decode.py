"""Decode throughput against a roofline: Dense vs the routed systems, same backbone, same prompts.

    python benchmarks/bench_decode.py [--checkpoint runs/tiny/checkpoints] [--data DIR] [--shape 160m]
        [--contexts 512 2048 8192] [--batches 1 8] [--systems kvquant mod independent triroute]
        [--steps 20] [--repeats 5] [--threads 1] [--budgets 0.35,0.25 1,1] [--device cpu|cuda] [--json] [--quick]

Systems (float32 compute, one fixed thread count, decode only):
- **Dense**: the best plain PyTorch decoder, not our engine forced dense: per layer a contiguous
  K/V cache [B, H_kv, T_max, d_h] in its compute dtype (float32: no cast in the step) and
  `scaled_dot_product_attention` (GQA) over it, a dense SwiGLU FFN of width d_ff; its weight matmuls
  are `triroute_kernels.decode_linear`, the engine's own (faster than BLAS at a few rows on this
  CPU), so a ratio compares the routing, not two matmul libraries. On a GPU (`--device cuda`) each of
  its steps is one replay of a CUDA graph (a static cache read whole with the keys past the position
  masked, as gpt-fast decodes; `DenseRunner`), `"cuda_graph": true` in its figures.
- **KV-quant-only, MoD, Independent combo, TriRoute**: `megatron_triroute.inference` (`InferenceModel`
  with its paged cache) on `systems.system_config(name, backbone)`, through its public `step` only.

Decisions. On the 160m-shaped SYNTHETIC backbone (`--shape`, random weights) every layer keeps its
real controller (built by the system, run in every step: its cost is in the timings) and the
decisions it returns are replaced by FORCED ones drawn before the run (`ForcedController`), in
exact proportions (`budget_mix`): for TriRoute the mix whose realised fractions are the budget's,
FLOPs `budget.flops_target` and KV memory `budget.mem_target` (0.55 / 0.40), solved at each context;
MoD and Independent process `router.mod_capacity` of the tokens; KV-quant-only stores every token
at its width. A layer-group follower reuses its leader's attention, as the real controller does.
The realised fractions, computed from the executed decisions with `routing.cost.hard_cost`, are
printed per cell. With `--checkpoint`, its trained TriRoute runs its own priced controller.

Protocol. The prompt's K/V are written straight into each cache (random values, widths in the mix's
exact proportions, by the engine's own cache write, into a cache the engine sizes itself) and each
request's routing state is set as a one-document prefill leaves it. Per (context, batch) cell,
every system gets one warm-up step, then Dense and the routed systems run interleaved in one
process (A B C .. A B C ..): `--repeats` runs of `--steps` decode steps each, the engine's audit off
(`audit=None`). Step time: median and interquartile range over the runs. Then two untimed steps per
system are counted: one under `op_counter.StepCounter` (top-level aten ops per layer, host syncs
per step), one with the audit on under the same counter (executed attention MACs: every matmul
neither operand of which is a weight, and SDPA kernels, from their shapes; audited: the engine's
`attn` counter, or Dense's formula).

Figures per cell. `limit_macs` (`limit`) = Dense MACs / system MACs per decoded token (every MAC:
projections, attention reads, experts, controller, LM head); `limit_bytes` = Dense bytes / system
bytes one step must read (weights it uses: heads some token reads, the distinct experts run, the
controller, the LM head; the K/V bytes of the keys in some head's range); the roofline time of a
step = sum over (layer, weights | attention) and the LM head of max(bytes / BW, FLOPs / peak), with
BW (a large copy) and peak (a large float32 matmul) measured in this run on `--threads` threads;
`roofline_efficiency` = roofline time / measured median step time (1 = the machine's limit for that
work); `roofline_efficiency_core` the same with the core's own float32 multiply-add peak for peak (on a
CPU with the C++ kernels: `triroute::fma_probe`, one thread; PyTorch's float32 matmul reaches about
two fifths of it on the AMD EPYC of the README, whose decode kernels run 16-lane multiply-adds of their
own, so the matmul probe is not their ceiling and this figure is the stricter one); `efficiency` =
speed-up / limit_macs (the MAC-only figure of earlier records);
`kv_bytes_ratio` = filled-slot bytes per prompt token over a 16-bit dense cache's (the budget's
reference); `kv_used_bytes` / `kv_resident_bytes` after the run (resident: every tensor the cache
holds, free pages and index included); `cost_audit_rel_err` = max over layers of |audited attention
+ expert MACs - hard_cost| / hard_cost on the audited step.

The serve-time dial (`--budgets F,M ...`, synthetic shape only): beside the budget's TriRoute, one
more TriRoute per (FLOPs, KV memory) target, named `triroute@F,M` (the same random weights; its
controllers forced to `budget_mix` at that target), timed in the same interleaved rounds as Dense
and every other system of the cell; `budget_dial` in the JSON gives per target and cell the
tokens/s over Dense's, the step-time ratio's median and IQR, and the realised fractions.

`--device cuda` puts every model, cache, forced decision and probe on the GPU (the engine takes its
Triton kernels there; the probes are a device copy and a float32 matmul; each timed run ends with a
device synchronise). Not yet run on a GPU. `--checkpoint` runs on the CPU only.

`--json` prints one object; its top-level figures are the synthetic shape's TriRoute at 2,048 context
(or the largest context below it), batch `min(--batches)` and (`_b8`) `max(--batches)`. `--quick`
runs tiny shapes in seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.forced_decisions import (  # noqa: E402
    ForcedController, budget_mix, exact_draw, force, measure_mix, realised_fractions)
from benchmarks.op_counter import StepCounter, model_weights  # noqa: E402
from megatron_triroute.config import ModelConfig, TriRouteConfig  # noqa: E402
from megatron_triroute.inference.attention import apply_rope, rope_tables  # noqa: E402
from megatron_triroute.inference.huge_pages import huge_page_copies, place_on_huge_pages  # noqa: E402
from megatron_triroute.routing.controller import RouterOutput  # noqa: E402
from megatron_triroute.routing.cost import bit_costs, expert_width, hard_cost  # noqa: E402
from megatron_triroute.routing.modes import SKIP, read_start  # noqa: E402
from megatron_triroute.systems import system_config  # noqa: E402
from triroute_kernels import decode_linear, rms_norm  # noqa: E402

ROUTED = ("kvquant", "mod", "independent", "triroute")
TARGETS = {"ops_per_layer": 120, "host_syncs_per_step": 0, "step_time_ratio_b1": 1.1, "speedup_vs_dense_b8": 0.9,
           "roofline_efficiency": 0.85, "executed_over_audited_attn": 1.25, "kv_resident_over_used": 1.1,
           "kv_bytes_ratio": (0.40, 0.02), "cost_audit_max_rel_err": 0.01}
"""The decode issue's targets (CPU, one thread, 160m, 2,048 context): printed beside the
measurements, never asserted. Upper bounds except speedup_vs_dense_b8 and roofline_efficiency."""
MAC_COUNTERS = ("q_proj", "k_proj", "v_proj", "o_proj", "attn", "experts", "controller")
WARMUP = 1


# --- statistics ---------------------------------------------------------------------------------
def spread(values: list[float]) -> dict:
    """Median and interquartile range (inclusive quartiles)."""
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return {"median": statistics.median(values), "q1": q1, "q3": q3, "iqr": q3 - q1}


# --- Dense baseline -----------------------------------------------------------------------------
class DenseDecoder(nn.Module):
    """Plain decoder: contiguous K/V cache in the compute dtype, SDPA, dense SwiGLU, its matmuls and
    RMS norms by the engine's `decode_linear` and `rms_norm` (as the routed systems'), the rotary
    table computed once per step. Random weights. `step` reads the cache up to the step's position;
    `static_step` keeps every shape fixed, for a CUDA graph (`DenseRunner` on a GPU)."""

    def __init__(self, m: ModelConfig, batch: int, max_len: int, seed: int = 0, kv_dtype=torch.float32,
                 device: torch.device | str = "cpu"):
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def w(*shape):
            return nn.Parameter(torch.randn(*shape, generator=g) * 0.02, requires_grad=False)

        self.m = m
        D, H, Hk, d, L = m.d_model, m.n_heads, m.n_kv_heads, m.d_head, m.n_layers
        self.emb = w(m.vocab_size, D)
        self.wq = nn.ParameterList(w(H * d, D) for _ in range(L))
        self.wkv = nn.ParameterList(w(2 * Hk * d, D) for _ in range(L))
        self.wo = nn.ParameterList(w(D, H * d) for _ in range(L))
        self.fc1 = nn.ParameterList(w(2 * m.d_ff, D) for _ in range(L))
        self.fc2 = nn.ParameterList(w(D, m.d_ff) for _ in range(L))
        self.head = w(m.vocab_size, D)
        self.to(device)
        self.ones = torch.ones(D, device=device)  # the norms' gains
        self.k = torch.zeros(L, batch, Hk, max_len, d, dtype=kv_dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.t = 0
        self.pos = torch.zeros(1, dtype=torch.long, device=device)  # static_step's position (step keeps t only)
        self.key_positions = torch.arange(max_len, device=device)

    def fill(self, length: int, seed: int = 1) -> None:
        """Write `length` prompt tokens of random K/V (the synthetic prefill)."""
        g = torch.Generator().manual_seed(seed)
        shape = self.k[:, :, :, :length].shape
        self.k[:, :, :, :length] = torch.randn(shape, generator=g).to(self.k.device, self.k.dtype)
        self.v[:, :, :, :length] = torch.randn(shape, generator=g).to(self.k.device, self.k.dtype)
        self.t = length
        self.pos.fill_(length)

    def attn_macs(self, t: int) -> int:
        """Attention MACs of one token at position t, all layers (2 d_h per (head, key))."""
        return self.m.n_layers * 2 * self.m.d_head * self.m.n_heads * (t + 1)

    def macs_per_token(self, t: int) -> int:
        """MACs one token at position t executes, in the audit's units (one per weight; 2 d_h per (head, key))."""
        m = self.m
        proj = (2 * m.n_heads + 2 * m.n_kv_heads) * m.d_head * m.d_model
        return m.n_layers * (proj + 3 * m.d_model * m.d_ff) + self.attn_macs(t) + m.d_model * m.vocab_size

    def _decode(self, tokens: torch.Tensor, position: torch.Tensor, attend) -> torch.Tensor:
        """Logits (B, V) of one new token per request at `position` ((1,) on the device): the layers'
        norms, projections and FFN; `attend(i, q, k, v)` stores layer i's new K and V (B, H_kv, 1, d,
        in the cache's dtype) and returns the attention output of q (B, H, 1, d), any shape of B rows."""
        m = self.m
        B = tokens.shape[0]
        x = self.emb[tokens]  # (B, D)
        # once per step for every layer (the engine's `prepare` looks its own up in `RopeCache`)
        cos, sin = rope_tables(position, m.d_head)
        for i in range(m.n_layers):
            h = rms_norm(x, self.ones, 1e-5)
            q = apply_rope(decode_linear(h, self.wq[i]).view(B, m.n_heads, 1, m.d_head), cos, sin)
            k, v = decode_linear(h, self.wkv[i]).view(B, 2, m.n_kv_heads, 1, m.d_head).unbind(1)
            o = attend(i, q, apply_rope(k, cos, sin).to(self.k.dtype), v.to(self.k.dtype))
            x = x + decode_linear(o.reshape(B, -1), self.wo[i])
            h = rms_norm(x, self.ones, 1e-5)
            gate, up = decode_linear(h, self.fc1[i]).chunk(2, -1)
            x = x + decode_linear(F.silu(gate) * up, self.fc2[i])
        return decode_linear(rms_norm(x, self.ones, 1e-5), self.head)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (B, V) of one new token per request: its K and V written at position `t`, the cache
        read up to it."""
        t = self.t

        def attend(i, q, k, v):
            self.k[i, :, :, t : t + 1], self.v[i, :, :, t : t + 1] = k, v
            kk, vv = _in_dtype(q.dtype, self.k[i, :, :, : t + 1], self.v[i, :, :, : t + 1])
            return F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)  # (B, H, 1, d)

        logits = self._decode(tokens, torch.tensor([t], device=tokens.device), attend)
        self.t = t + 1
        return logits

    @torch.no_grad()
    def static_step(self, tokens: torch.Tensor) -> torch.Tensor:
        """`step` with every shape and address fixed, as a CUDA graph needs it (gpt-fast's decode): the
        position is the device tensor `pos` (advanced in place), the new K and V are written there by
        `index_copy_`, and attention reads the whole cache with the keys past the position masked.
        The same logits as `step` up to rounding; the host's `t` is the caller's to advance."""
        m = self.m
        mask = (self.key_positions <= self.pos).view(1, 1, 1, -1)

        def attend(i, q, k, v):
            self.k[i].index_copy_(2, self.pos, k)
            self.v[i].index_copy_(2, self.pos, v)
            kk, vv = _in_dtype(q.dtype, self.k[i], self.v[i])
            # a KV head's G query heads as its G query rows (B, H_kv, G, d): GQA without repeating K and V,
            # which SDPA's backends that take a mask would do for enable_gqa
            return F.scaled_dot_product_attention(q.view(q.shape[0], m.n_kv_heads, -1, m.d_head), kk, vv, attn_mask=mask)

        logits = self._decode(tokens, self.pos, attend)
        self.pos += 1
        return logits


def _in_dtype(dtype: torch.dtype, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V cast to the compute dtype where the cache holds another."""
    return (k, v) if k.dtype == dtype else (k.to(dtype), v.to(dtype))


# --- routed systems through the engine ----------------------------------------------------------
def build_routed(config: TriRouteConfig, seed: int = 0, huge_pages: bool = True, device: torch.device | str = "cpu"):
    """Random-weight `InferenceModel` on `device`, each layer's real controller wrapped in a
    `ForcedController`; on a CPU its weights on huge pages as the engine's checkpoint loader places
    them (`huge_pages` False: left where they were made, for a comparison)."""
    from megatron_triroute.inference.model import InferenceModel

    model = InferenceModel(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02 if p.dim() >= 2 else torch.ones(p.shape))
    model.to(device)
    if huge_pages:
        place_on_huge_pages(model)
    for layer in model.layers:
        layer.controller = ForcedController(layer.controller, config)
    return model.eval()


def fill_cache(model, context: int, batch: int, bit_probs, seed: int):
    """A cache (the engine's default sizing: it grows as the writes need) holding `batch` requests of
    `context` random prompt tokens, K/V random at widths in `bit_probs`' exact proportions (written by
    the engine's own cache write), and each request's routing state. Also returns the widths, (L, B, context)."""
    from megatron_triroute.inference.side_state import SideState

    cfg = model.config
    m, r = cfg.model, cfg.router
    cache = model.new_cache()
    rids = list(range(batch))
    for rid in rids:
        cache.add_request(rid)
    g = torch.Generator().manual_seed(seed)
    probs = bit_probs if r.bit_routing else [1.0]
    row = torch.arange(batch).repeat_interleave(context)
    positions = torch.arange(context).repeat(batch)
    widths = []
    for layer in range(m.n_layers):
        option = exact_draw(probs, row.numel(), g)
        k = torch.randn(row.numel(), m.n_kv_heads, m.d_head, generator=g).to(model.device)
        v = torch.randn(row.numel(), m.n_kv_heads, m.d_head, generator=g).to(model.device)
        cache.write(layer, rids, row, option, positions, k, v)
        widths.append(option.view(batch, context))
    last = torch.randint(0, m.vocab_size, (batch,), generator=g)
    states = [SideState(length=context, last_token=int(t), doc_start=0, word_start=context - 1) for t in last]
    return cache, rids, states, last, torch.stack(widths)


def resident_bytes(obj) -> int:
    """Bytes of every tensor storage reachable from `obj`'s attributes (each storage once)."""
    return sum(reachable_storages(obj).values())


def reachable_storages(obj) -> dict[int, int]:
    """{address: bytes} of every tensor storage reachable from `obj`'s attributes."""
    storages, seen, stack = {}, set(), [obj]
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            s = o.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set)):
            stack.extend(o)
        elif hasattr(o, "__dict__") and not isinstance(o, type):
            stack.extend(vars(o).values())
    return storages


class RoutedRunner:
    """One routed system's decode state for a cell: its cache, requests and the decisions it took."""

    def __init__(self, model, context: int, batch: int, mix: dict, steps: int, repeats: int):
        self.model, self.batch, self.context = model, batch, context
        force(model, mix, WARMUP + steps * repeats + 2, batch)
        self.cache, self.rids, self.states, self.tokens, self.widths = fill_cache(model, context, batch, mix["bits"], 7)
        self.kv_bytes_per_token = self.cache.memory()["used"] / (batch * context)
        self.cache.host_reads = 0  # from here on: the decode steps' own
        self.ones = torch.ones(batch, dtype=torch.long)
        self.record: list[tuple[torch.Tensor, list[RouterOutput]]] = []  # (positions (B, 1), outs) per step

    def step(self, audit=None, counter=None, scheduler_counter=None) -> None:
        """One decode step as `InferenceModel.step` runs it (prepare on the host, the device step,
        finish); `counter` counts the device step alone, `scheduler_counter` the host parts."""
        import contextlib

        host = scheduler_counter or contextlib.nullcontext()
        with torch.no_grad():
            with host:
                batch = self.model.prepare(self.tokens.view(self.batch, 1), self.ones, self.states, self.cache,
                                           self.rids, audit)
            with counter or contextlib.nullcontext():
                logits, outs = self.model.forward_step(batch, self.cache)
            with host:
                self.model.finish(batch, outs, self.cache, self.rids, audit)
        self.record.append((batch.positions, outs))
        self.tokens = logits.argmax(-1)


class DenseRunner:
    """The Dense decoder's steps for a cell. On a GPU each step is one replay of a CUDA graph of
    `DenseDecoder.static_step` (the sampling's argmax inside it), the field's way to decode a small
    batch without its launches' cost (`graphed`); on a CPU, `DenseDecoder.step`."""

    def __init__(self, m: ModelConfig, context: int, batch: int, steps: int, repeats: int,
                 device: torch.device | str = "cpu", graphed: bool | None = None):
        self.dec = DenseDecoder(m, batch, context + WARMUP + steps * repeats + 4, device=device)
        self.dec.fill(context)
        # on a CPU on huge pages as the routed systems' weights, and its contiguous K/V cache as well
        place_on_huge_pages(self.dec)
        if self.dec.k.device.type == "cpu":
            self.dec.k, self.dec.v = huge_page_copies([self.dec.k, self.dec.v])
        self.batch, self.tokens = batch, torch.zeros(batch, dtype=torch.long, device=device)
        self.graphed = self.dec.k.device.type == "cuda" if graphed is None else graphed
        self.graph = self._capture() if self.graphed else None

    def _capture(self):
        """A CUDA graph of one static step that leaves the next tokens in `self.tokens`: two warm-up
        steps on a side stream (which CUDA graphs need before a capture), the position put back, the
        capture (which runs nothing)."""
        dec, start = self.dec, self.dec.t
        side = torch.cuda.Stream(self.tokens.device)
        side.wait_stream(torch.cuda.current_stream(self.tokens.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                dec.static_step(self.tokens)
        torch.cuda.current_stream(self.tokens.device).wait_stream(side)
        dec.pos.fill_(start)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.tokens.copy_(dec.static_step(self.tokens).argmax(-1))
        return graph

    def step(self, audit=None, eager: bool = False) -> None:
        """One decode step; `eager`: the graph's ops dispatched one by one (what the op counter sees)."""
        if self.graph is None:
            self.tokens = self.dec.step(self.tokens).argmax(-1)
            return
        if eager:
            self.tokens.copy_(self.dec.static_step(self.tokens).argmax(-1))
        else:
            self.graph.replay()
        self.dec.t += 1


# --- roofline -----------------------------------------------------------------------------------
def synchronized_clock(device: torch.device) -> float:
    """`time.perf_counter()` once the device's queued work is done (a CUDA synchronise; a CPU runs
    its ops as they are called)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class MachinePeaks:
    """Memory bandwidth (a large copy: bytes read + written) and float32 matmul peak, best of 3, on
    the current thread count; `probe()` measures once more (run in every timed round, so that the
    roofline of a cell sees the machine's load during that cell's steps). On a CPU where the C++
    kernels are built, also the core's own float32 multiply-add peak (`core_gflops`:
    `triroute::fma_probe`, registers only, the widest vectors the kernels are built for, one thread),
    the ceiling of the decode kernels' vector code, which the matmul probe (PyTorch's BLAS) can fall
    well short of; None elsewhere."""

    REPEATS = 3
    """Probes per measurement (the best is kept)."""

    def __init__(self, quick: bool = False, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        gpu = self.device.type == "cuda"
        n = (16 if quick else 1024 if gpu else 256) * 2**20 // 4
        self.src, self.dst = torch.randn(n, device=device), torch.empty(n, device=device)
        size = 256 if quick else 8192 if gpu else 1024
        self.a, self.b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
        self.fma_rounds = 10**5 if quick else 10**6  # about 0.15 / 1.5 ms a probe at this core's peak

    def probe(self) -> dict:
        copy, mm = [], []
        for _ in range(self.REPEATS):
            start = synchronized_clock(self.device)
            self.dst.copy_(self.src)
            copy.append(synchronized_clock(self.device) - start)
            start = synchronized_clock(self.device)
            torch.mm(self.a, self.b)
            mm.append(synchronized_clock(self.device) - start)
        return {"bandwidth_gb_s": 2 * self.src.nbytes / min(copy) / 1e9,
                "peak_gflops": 2 * self.a.shape[0] ** 3 / min(mm) / 1e9, "core_gflops": self.core_gflops()}

    def core_gflops(self) -> float | None:
        """The core's float32 multiply-add peak, best of 3 (None off a CPU or without the C++ kernels)."""
        from triroute_kernels import cpu_ops_available

        if self.device.type != "cpu" or not cpu_ops_available():
            return None
        runs = [torch.ops.triroute.fma_probe(self.fma_rounds) for _ in range(self.REPEATS)]
        return max(flops / max(seconds, 1e-9) for flops, seconds in runs) / 1e9


def core_peak(peaks: dict) -> str:
    """The core's multiply-add peak for a log line ("" where not measured)."""
    if peaks.get("core_gflops") is None:
        return ""
    return f", {peaks['core_gflops']:.1f} GFLOP/s the core's multiply-add peak"


def roofline_seconds(parts: list[tuple[float, float]], peaks: dict, compute: str = "peak_gflops") -> float | None:
    """sum over (bytes, FLOPs) parts of max(bytes / BW, FLOPs / peak), the peak `peaks[compute]`
    (the matmul probe's, or `core_gflops`; None where that peak was not measured)."""
    if peaks.get(compute) is None:
        return None
    bw, peak = peaks["bandwidth_gb_s"] * 1e9, peaks[compute] * 1e9
    return sum(max(b / bw, f / peak) for b, f in parts)


def dense_roofline_parts(dec: DenseDecoder, batch: int, t: int) -> list[tuple[float, float]]:
    """(bytes, FLOPs) of one Dense step at query position t: per layer its weights and its K/V."""
    m, elt = dec.m, dec.wq[0].element_size()
    weights = (2 * m.n_heads + 2 * m.n_kv_heads) * m.d_head * m.d_model + 3 * m.d_model * m.d_ff
    kv = 2 * m.n_kv_heads * m.d_head * (t + 1) * dec.k.element_size() * batch
    layer = [(weights * elt, 2.0 * weights * batch), (kv, 2.0 * 2 * m.d_head * m.n_heads * (t + 1) * batch)]
    return layer * m.n_layers + [(m.vocab_size * m.d_model * elt, 2.0 * m.d_model * m.vocab_size * batch)]


def routed_roofline_parts(run: RoutedRunner, audit, t: int) -> list[tuple[float, float]]:
    """(bytes, FLOPs) of the audited routed step at query position t: per layer the weights it uses
    (K/V projections; Q and O rows of heads some request reads; the distinct experts run; the
    controller) with the audited projection, expert and controller MACs, and the K/V bytes of the
    keys in some head's range of each (request, KV group) with the audited attention MACs."""
    model, cfg = run.model, run.model.config
    m, r = cfg.model, cfg.router
    elt = model.lm_head.weight.element_size()
    widths = torch.cat([run.widths] + [torch.stack([o.bits.y.argmax(-1).view(-1) for o in outs]).cpu().unsqueeze(-1)
                                      for _, outs in run.record], -1)  # (L, B, positions 0..t), on the host
    head_bytes = bit_costs(r, m) / 8 / m.n_kv_heads  # per width: one token's K+V of one KV head
    per_pos = head_bytes[widths[..., : t + 1]]  # (L, B, t+1)
    before = F.pad(per_pos.cumsum(-1), (1, 0))  # before[..., p]: bytes at positions < p
    _, outs = run.record[-1]
    parts = []
    G = m.n_heads // m.n_kv_heads
    for layer, o in enumerate(outs):
        mode = o.attn.y.argmax(-1).view(run.batch, m.n_heads).cpu()  # (B, H)
        lo = read_start(torch.full_like(mode, t), mode, r.window).view(run.batch, m.n_kv_heads, G).amin(-1)  # (B, Hk)
        kv = (before[layer, :, t + 1].view(-1, 1) - before[layer].gather(1, lo.clamp(max=t + 1))).clamp_min(0).sum()
        heads = int((mode != SKIP).any(0).sum())
        d_e = expert_width(m, r) if o.experts is not None else m.d_ff
        ffn = m.d_ff if o.experts is None else int(torch.unique(o.experts.index[o.experts.index >= 0]).numel()) * d_e
        controller = sum(mod.weight.numel() for mod in model.layers[layer].controller.modules()
                         if isinstance(mod, nn.Linear))
        weights = (2 * heads + 2 * m.n_kv_heads) * m.d_head * m.d_model + 3 * m.d_model * ffn + controller
        c = audit.layers[layer]
        weight_macs = sum(c[n] for n in ("q_proj", "k_proj", "v_proj", "o_proj", "experts", "controller"))
        parts += [(weights * elt, 2.0 * weight_macs), (float(kv), 2.0 * c["attn"])]
    return parts + [(m.vocab_size * m.d_model * elt, 2.0 * audit.lm_head)]


def bytes_limit_parts(parts) -> float:
    return sum(b for b, _ in parts)


# --- per-cell measurements ----------------------------------------------------------------------
def audit_macs(audit) -> int:
    """Every multiply-accumulate the engine executed (projections, reads, experts, controller, LM head)."""
    return sum(audit.total(n) for n in MAC_COUNTERS) + audit.lm_head


def cost_audit_error(audit, steps: list[tuple[torch.Tensor, list[RouterOutput]]], config: TriRouteConfig) -> float:
    """Max over layers of |audited attention + expert MACs - hard_cost of the same decisions| / hard_cost."""
    m, r = config.model, config.router
    worst = 0.0
    for layer in range(m.n_layers):
        model_macs = 0.0
        for positions, outs in steps:
            o = outs[layer]
            index = None if o.experts is None else o.experts.index
            hc = hard_cost(o.attn.y.argmax(-1), index, o.bits.y.argmax(-1), positions.to(o.attn.y.device), m, r)
            model_macs += float(hc.flops.sum())
        counted = audit.layers[layer]["attn"] + audit.layers[layer]["experts"]
        worst = max(worst, abs(counted - model_macs) / max(model_macs, 1.0))
    return worst


def ffn_weight_read_ratio(steps: list[tuple[torch.Tensor, list[RouterOutput]]], config: TriRouteConfig) -> float:
    """Mean over decode steps of the FFN weight bytes read over a dense FFN's: each distinct expert
    run in the step is read once, sum_l |experts run| d_e / (L d_ff)."""
    m, r = config.model, config.router
    ratios = []
    for _, outs in steps:
        width = 0
        for o in outs:
            if o.experts is None:
                width += m.d_ff
            else:
                width += int(torch.unique(o.experts.index[o.experts.index >= 0]).numel()) * expert_width(m, r)
        ratios.append(width / (len(outs) * m.d_ff))
    return statistics.mean(ratios)


def count_steps(runner, weights, audit=None) -> tuple[StepCounter, StepCounter]:
    """Two untimed steps: one as timed (audit off), one with `audit`, each under a StepCounter.
    A routed runner's counters see its device step only (`InferenceModel.forward_step`); its
    host-side scheduling (prepare, finish) is counted apart, in `runner.scheduler`."""
    plain, audited = StepCounter(weights), StepCounter(weights)
    if isinstance(runner, RoutedRunner):
        runner.scheduler = StepCounter()
        runner.step(counter=plain, scheduler_counter=runner.scheduler)
        runner.step(audit, counter=audited)
        return plain, audited
    with plain:  # a graphed Dense's step op by op: a replay dispatches nothing the counter sees
        runner.step(eager=True)
    with audited:
        runner.step(audit, eager=True)
    return plain, audited


def counter_figures(plain: StepCounter, audited: StepCounter, n_layers: int) -> dict:
    """Ops and syncs of the counted step; executed attention MACs from the matmul shapes (a
    routed runner replaces them with its kernels' own counters: the counter cannot see inside
    `foreign_ops`)."""
    return {"ops_per_layer": plain.ops / n_layers, "host_syncs_per_step": plain.host_syncs,
            "host_sync_ops": plain.syncs, "executed_attn_macs": audited.activation_macs,
            "uncounted_ops": plain.foreign_ops}


def timed(runners: dict, steps: int, repeats: int, machine: MachinePeaks) -> tuple[dict[str, list[float]], dict]:
    """Seconds per step of each runner: a warm-up step each, then `repeats` rounds in which every
    runner in turn runs `steps` steps (A B C .. A B C ..), each round ending with a machine probe.
    Returns the times and the probes' medians."""
    for runner in runners.values():
        runner.step()
    times, probes = {name: [] for name in runners}, []
    for _ in range(repeats):
        for name, runner in runners.items():
            start = synchronized_clock(machine.device)
            for _ in range(steps):
                runner.step()
            times[name].append((synchronized_clock(machine.device) - start) / steps)
        probes.append(machine.probe())
    return times, {k: None if probes[0][k] is None else statistics.median(p[k] for p in probes) for k in probes[0]}


def run_cell(base: TriRouteConfig, models: dict, mixes: dict, context: int, batch: int, steps: int, repeats: int,
             machine: MachinePeaks) -> dict:
    """Every system of one (context, batch) cell, interleaved; figures per system (and the cell's
    machine peaks under `"peaks"`)."""
    from megatron_triroute.inference.audit import CostAudit

    m = base.model
    runners = {"dense": DenseRunner(m, context, batch, steps, repeats, machine.device)}
    runners |= {name: RoutedRunner(model, context, batch, mixes[name], steps, repeats) for name, model in models.items()}
    times, peaks = timed(runners, steps, repeats, machine)
    dense_run = runners["dense"]
    plain, audited = count_steps(dense_run, model_weights(dense_run.dec))
    t = dense_run.dec.t - 1  # the audited step's query position
    dense = {"step_s": spread(times["dense"]), "step_s_runs": times["dense"], "cuda_graph": dense_run.graphed}
    dense["tokens_per_s"] = batch / dense["step_s"]["median"]
    dense["tokens_per_s_runs"] = [batch / s for s in times["dense"]]
    dense |= counter_figures(plain, audited, m.n_layers)
    dense["audited_attn_macs"] = batch * dense_run.dec.attn_macs(t)
    dense["macs_per_token"] = dense_run.dec.macs_per_token(t)
    parts = dense_roofline_parts(dense_run.dec, batch, t)
    dense["bytes_per_step"] = bytes_limit_parts(parts)
    dense["roofline_s"] = roofline_seconds(parts, peaks)
    dense["roofline_s_core"] = roofline_seconds(parts, peaks, "core_gflops")
    dense["kv_bytes_per_token"] = 2 * m.n_layers * m.d_kv * dense_run.dec.k.element_size()
    dense["kv_used_bytes"] = 2 * dense_run.dec.k[:, :, :, : dense_run.dec.t].nbytes
    dense["kv_resident_bytes"] = dense_run.dec.k.nbytes + dense_run.dec.v.nbytes
    row = {"dense": dense}
    dense_kv16 = 2 * m.n_layers * m.d_kv * 2
    for name, runner in runners.items():
        if name == "dense":
            continue
        cfg = runner.model.config
        timed_steps = runner.record[WARMUP:]
        audit = CostAudit(cfg.model.n_layers)
        plain, audited = count_steps(runner, model_weights(runner.model), audit)
        t = int(runner.record[-1][0][0, 0])
        r = {"step_s": spread(times[name]), "step_s_runs": times[name]}
        r["tokens_per_s"] = batch / r["step_s"]["median"]
        r["tokens_per_s_runs"] = [batch / s for s in times[name]]
        r |= counter_figures(plain, audited, cfg.model.n_layers)
        r["executed_attn_macs"] = audit.total_executed("attn")  # the attention kernel's own counters
        r["executed_bytes_read"] = audit.total_executed("bytes_read")
        r["scheduler_ops_per_step"] = runner.scheduler.ops
        r["scheduler_host_reads_per_step"] = runner.cache.host_reads / len(runner.record)
        r["audited_attn_macs"] = audit.total("attn")
        r["macs_per_token"] = audit_macs(audit) / audit.tokens
        parts = routed_roofline_parts(runner, audit, t)
        r["bytes_per_step"] = bytes_limit_parts(parts)
        r["roofline_s"] = roofline_seconds(parts, peaks)
        r["roofline_s_core"] = roofline_seconds(parts, peaks, "core_gflops")
        r["kv_bytes_per_token"] = runner.kv_bytes_per_token
        r["kv_bytes_ratio"] = runner.kv_bytes_per_token / dense_kv16
        r["kv_used_bytes"] = runner.cache.memory()["used"]
        r["kv_resident_bytes"] = resident_bytes(runner.cache)
        r["cost_audit_rel_err"] = cost_audit_error(audit, runner.record[-1:], cfg)
        r["ffn_weight_read_ratio"] = ffn_weight_read_ratio(timed_steps, cfg)
        r["decode_mix"] = measure_mix([outs for _, outs in runner.record], len(cfg.router.bits))
        r["realised"] = realised_fractions(runner.record, cfg)  # every step of the cell: the whole schedule
        r["speedup_vs_dense"] = r["tokens_per_s"] / dense["tokens_per_s"]
        r["step_time_ratio"] = r["step_s"]["median"] / dense["step_s"]["median"]
        r["step_time_ratio_runs"] = spread([a / b for a, b in zip(times[name], times["dense"])])
        r["limit"] = r["limit_macs"] = dense["macs_per_token"] / r["macs_per_token"]
        r["limit_bytes"] = dense["bytes_per_step"] / r["bytes_per_step"]
        r["efficiency"] = r["speedup_vs_dense"] / r["limit"]
        row[name] = r
    for r in row.values():
        r["roofline_efficiency"] = r["roofline_s"] / r["step_s"]["median"]
        core = r["roofline_s_core"]
        r["roofline_efficiency_core"] = None if core is None else core / r["step_s"]["median"]
        r["executed_over_audited_attn"] = r["executed_attn_macs"] / max(r["audited_attn_macs"], 1)
        r["kv_resident_over_used"] = r["kv_resident_bytes"] / max(r["kv_used_bytes"], 1)
    return row | {"peaks": peaks}


def describe(label: str, key: str, name: str, r: dict) -> str:
    s = r["step_s"]
    line = (f"[{label}] {key} {name:11s} {r['tokens_per_s']:8.2f} tok/s  step {1e3 * s['median']:8.1f} ms "
            f"(IQR {1e3 * s['q1']:.1f}..{1e3 * s['q3']:.1f})  roofline eff {r['roofline_efficiency']:.2f}"
            + ("" if r["roofline_efficiency_core"] is None
               else f" ({r['roofline_efficiency_core']:.2f} at the core's peak)")
            + "  "
            f"ops/layer {r['ops_per_layer']:.0f}  syncs/step {r['host_syncs_per_step']}  "
            f"attn exec/audit {r['executed_over_audited_attn']:.2f}  KV resident/used {r['kv_resident_over_used']:.2f}")
    if name != "dense":
        line += (f"\n    step time / Dense {r['step_time_ratio']:.2f} (per-round IQR {r['step_time_ratio_runs']['q1']:.2f}"
                 f"..{r['step_time_ratio_runs']['q3']:.2f})  limit MACs {r['limit_macs']:.2f} bytes "
                 f"{r['limit_bytes']:.2f}  kv {r['kv_bytes_ratio']:.3f}  realised FLOPs {r['realised']['flops']:.3f} "
                 f"mem {r['realised']['mem']:.3f}  audit err {r['cost_audit_rel_err']:.1e}\n    scheduler (host, "
                 f"outside the step): {r['scheduler_ops_per_step']} ops/step, "
                 f"{r['scheduler_host_reads_per_step']:.3f} device reads/step")
    return line


def budget_name(flops: float, mem: float) -> str:
    """The dial's system name for a (FLOPs, KV memory) target: `triroute@0.35,0.25`."""
    return f"triroute@{flops:g},{mem:g}"


def parse_budgets(parser: argparse.ArgumentParser, values: list[str]) -> list[tuple[float, float]]:
    """`--budgets`' FLOPS,MEM strings as (flops, mem) pairs of fractions in (0, 1], else the parser's
    error naming the form."""
    try:
        budgets = [tuple(float(x) for x in b.split(",")) for b in values]
    except ValueError:
        parser.error(f"--budgets {' '.join(values)}: each is FLOPS,MEM, e.g. 0.35,0.25")
    for b in budgets:
        if len(b) != 2 or not all(0 < x <= 1 for x in b):
            parser.error(f"--budgets: {','.join(f'{x:g}' for x in b)} is not a pair of fractions in (0, 1], "
                         "e.g. 0.35,0.25")
    return budgets


def at_budget(base: TriRouteConfig, flops: float, mem: float) -> TriRouteConfig:
    """TriRoute on `base`'s backbone with the budget's targets set to (flops, mem)."""
    cfg = system_config("triroute", base)
    cfg.budget = dataclasses.replace(cfg.budget, flops_target=flops, mem_target=mem)
    return cfg.validate()


def bench(label: str, base: TriRouteConfig, systems, contexts, batches, steps, repeats, machine, trained=None,
          log=print, budgets=()):
    """Rows `ctx{C}_b{B}` -> {system: figures} for every context and batch size; `budgets`: (FLOPs,
    memory) targets, each one more TriRoute (`budget_name`) in every cell."""
    device = machine.device
    models = {name: build_routed(system_config(name, base), device=device) for name in systems}
    if trained is not None:
        models["triroute"] = trained
    models |= {budget_name(f, m): build_routed(at_budget(base, f, m), device=device) for f, m in budgets}
    rows = {}
    for context in contexts:
        mixes = {name: budget_mix(model.config, context) for name, model in models.items()}
        for name in mixes:
            if name.startswith("triroute"):
                log(f"[{label}] context {context}: {name}'s forced mix {json.dumps(mixes[name])}")
        for batch in batches:
            key = f"ctx{context}_b{batch}"
            rows[key] = run_cell(base, models, mixes, context, batch, steps, repeats, machine)
            p = rows[key]["peaks"]
            log(f"[{label}] {key} machine during the cell (median of the rounds' probes): {p['bandwidth_gb_s']:.1f} "
                f"GB/s copy, {p['peak_gflops']:.1f} GFLOP/s matmul" + core_peak(p))
            for name, r in rows[key].items():
                if name != "peaks":
                    log(describe(label, key, name, r))
    return rows


def load_checkpoint_model(checkpoint: str, data: str | None):
    """The trained `InferenceModel` of a run's checkpoint, and its tokenizer."""
    from megatron_triroute.evaluation.loading import load_for_evaluation

    loaded = load_for_evaluation(checkpoint, data)
    return loaded.model, loaded.processor


def checkpoint_mix(model, processor, length: int) -> dict:
    """Realised decision mix of the trained controller on real code (json.decoder's source), one
    prefill of `length` tokens (printed for reference)."""
    import json.decoder

    from megatron_triroute.inference.side_state import SideState

    ids = processor.encode(inspect.getsource(json.decoder))[:length]
    cache = model.new_cache()
    cache.add_request(0)
    _, outs = model.step(torch.tensor([ids]), torch.tensor([len(ids)]), [SideState()], cache, [0])
    return measure_mix([outs], len(model.config.router.bits))


def budget_dial(rows: dict, budgets) -> list[dict]:
    """Per (FLOPs, memory) target: per cell TriRoute's tokens/s over Dense's, the step-time ratio
    (median of the per-round ratios, and their IQR) and the realised fractions."""
    dial = []
    for flops, mem in budgets:
        name, cells = budget_name(flops, mem), {}
        for key, row in rows.items():
            r = row[name]
            cells[key] = {"speedup_vs_dense": r["speedup_vs_dense"], "step_time_ratio": r["step_time_ratio_runs"],
                          "tokens_per_s": r["tokens_per_s"], "realised": r["realised"],
                          "kv_bytes_ratio": r["kv_bytes_ratio"], "roofline_efficiency": r["roofline_efficiency"]}
        dial.append({"flops_target": flops, "mem_target": mem, "system": name, "cells": cells})
    return dial


def headline(rows: dict, contexts, batches) -> dict:
    """The JSON's top-level figures: TriRoute at 2,048 context (or the largest context below it)."""
    ctx = max([c for c in contexts if c <= 2048] or [min(contexts)])
    out = {"headline_context": ctx}
    b1, b8 = min(batches), max(batches)
    for b, suffix in ((b1, ""), (b8, "_b8")):
        r = rows[f"ctx{ctx}_b{b}"]["triroute"]
        for k in ("speedup_vs_dense", "limit", "efficiency", "ffn_weight_read_ratio", "roofline_efficiency",
                  "roofline_efficiency_core", "limit_bytes"):
            out[k + suffix] = r[k]
    r = rows[f"ctx{ctx}_b{b1}"]["triroute"]
    out["step_time_ratio_b1"] = r["step_time_ratio"]
    for k in ("kv_bytes_ratio", "ops_per_layer", "host_syncs_per_step", "executed_over_audited_attn",
              "kv_resident_over_used", "scheduler_ops_per_step", "scheduler_host_reads_per_step"):
        out[k] = r[k]
    out["realised_fractions"] = r["realised"]
    out["cost_audit_max_rel_err"] = max(r["cost_audit_rel_err"] for row in rows.values()
                                        for name, r in row.items() if name not in ("dense", "peaks"))
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default=None, help="a trained run's checkpoint root (its TriRoute model and shape)")
    p.add_argument("--data", default=None, help="the run's data directory (default: its recorded data.path)")
    p.add_argument("--shape", default="160m", help="recipe whose backbone is benchmarked SYNTHETICALLY ('' = none)")
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--systems", nargs="+", choices=ROUTED, default=list(ROUTED),
                   help="routed systems beside Dense (the JSON headline needs triroute)")
    p.add_argument("--steps", type=int, default=20, help="decode steps per timed run")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per system, interleaved; median and IQR")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--budgets", nargs="+", default=[], metavar="FLOPS,MEM",
                   help="the serve-time dial: one more TriRoute per (FLOPs, KV memory) target, synthetic shape only")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the models, caches and probes run (cuda: the engine's Triton kernels)")
    p.add_argument("--quick", action="store_true", help="tiny shapes and contexts: seconds, for tests")
    p.add_argument("--json", action="store_true", help="print one JSON object (progress goes to stderr)")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible here")
    if a.device != "cpu" and a.checkpoint:
        p.error("--checkpoint runs on the CPU only; drop --device")
    a.budgets = parse_budgets(p, a.budgets)
    if a.budgets and not a.shape:
        p.error("--budgets runs on the synthetic shape (--shape), whose controllers are forced to each target")
    if a.quick:
        a.shape, a.contexts, a.batches, a.steps, a.repeats = "tiny", [64], [1, 8], 1, 2
    if a.steps < 1 or a.repeats < 2:
        p.error(f"--steps {a.steps} --repeats {a.repeats}: need steps >= 1 and repeats >= 2 (the IQR); "
                "the protocol is --steps 20 --repeats 5")
    if a.shape and "triroute" not in a.systems:
        p.error("--systems must include triroute: the headline figures are TriRoute's")
    return a


def main(argv=None) -> dict:
    threads = torch.get_num_threads()
    try:
        with torch.no_grad():  # scoped: an in-process caller keeps its autograd state and thread count
            return _main(argv)
    finally:
        torch.set_num_threads(threads)


def _main(argv=None) -> dict:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if a.json else (lambda s: print(s, flush=True))
    machine = MachinePeaks(a.quick, a.device)
    peaks = machine.probe()
    result = {"threads": a.threads, "device": a.device, "machine": platform.machine(), "torch": torch.__version__,
              "contexts": a.contexts, "batches": a.batches, "systems": a.systems, "steps": a.steps,
              "repeats": a.repeats, "targets": TARGETS, "peaks": peaks,
              "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    log(f"machine: {peaks['bandwidth_gb_s']:.1f} GB/s copy, {peaks['peak_gflops']:.1f} GFLOP/s float32 matmul"
        f"{core_peak(peaks)} on {a.threads} thread(s); load average {result['load_average']}")
    if a.checkpoint:
        model, processor = load_checkpoint_model(a.checkpoint, a.data)
        result["checkpoint_mix"] = checkpoint_mix(model, processor, 512)
        log(f"checkpoint decision mix (prefill of real code): {json.dumps(result['checkpoint_mix'])}")
        result["checkpoint"] = bench("checkpoint", model.config, a.systems, a.contexts, a.batches, a.steps, a.repeats,
                                     machine, model, log)
    if a.shape:
        from megatron_triroute.training.recipes import get_recipe

        base = get_recipe(a.shape).triroute.validate()
        result["synthetic_shape"] = a.shape
        result["synthetic_mix"] = {c: budget_mix(system_config("triroute", base), c) for c in a.contexts}
        log(f"{a.shape} shape is SYNTHETIC: random weights, real controllers with forced decisions")
        rows = bench(f"{a.shape} SYNTHETIC", base, a.systems, a.contexts, a.batches, a.steps, a.repeats,
                     machine, None, log, a.budgets)
        result["synthetic"] = rows
        result |= headline(rows, a.contexts, a.batches)
        if a.budgets:
            result["budget_dial"] = budget_dial(rows, a.budgets)
            for entry in result["budget_dial"]:
                log(f"dial ({entry['flops_target']:g}, {entry['mem_target']:g}): " + "; ".join(
                    f"{key} {c['speedup_vs_dense']:.2f}x Dense's tokens/s (step ratio "
                    f"{c['step_time_ratio']['median']:.2f} [{c['step_time_ratio']['q1']:.2f}-"
                    f"{c['step_time_ratio']['q3']:.2f}]), realised FLOPs {c['realised']['flops']:.3f} mem "
                    f"{c['realised']['mem']:.3f}" for key, c in entry["cells"].items()))
        t = TARGETS
        log(f"headline ({a.shape} SYNTHETIC, TriRoute, context {result['headline_context']}; target in brackets): "
            f"step time / Dense b1 {result['step_time_ratio_b1']:.2f} [<= {t['step_time_ratio_b1']}], "
            f"speed-up b8 {result['speedup_vs_dense_b8']:.2f} [>= {t['speedup_vs_dense_b8']}], roofline efficiency "
            f"{result['roofline_efficiency']:.2f} / {result['roofline_efficiency_b8']:.2f} [>= {t['roofline_efficiency']}]"
            + ("" if result["roofline_efficiency_core"] is None else
               f" ({result['roofline_efficiency_core']:.2f} / {result['roofline_efficiency_core_b8']:.2f} at the core's "
               "multiply-add peak)") + ", "
            f"ops/layer {result['ops_per_layer']:.0f} [<= {t['ops_per_layer']}], host syncs/step "
            f"{result['host_syncs_per_step']} [{t['host_syncs_per_step']}], executed/audited attention "
            f"{result['executed_over_audited_attn']:.2f} [<= {t['executed_over_audited_attn']}], KV resident/used "
            f"{result['kv_resident_over_used']:.2f} [<= {t['kv_resident_over_used']}], kv bytes "
            f"{result['kv_bytes_ratio']:.3f} [{t['kv_bytes_ratio'][0]} +- {t['kv_bytes_ratio'][1]}], realised "
            f"FLOPs {result['realised_fractions']['flops']:.3f} / mem {result['realised_fractions']['mem']:.3f} "
            f"[0.55 / 0.40]; MAC-only efficiency {result['efficiency']:.2f} / {result['efficiency_b8']:.2f}")
    if a.json:
        print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
