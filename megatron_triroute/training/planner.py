"""Capacity planner: memory per rank of a layout, and the layouts that fit a cluster (ours).

Memory per rank, from the config alone (`estimate_rank_memory`):
- parameters on the most loaded rank: the pipeline stage holding the embedding and the output
  layer (both, at pipeline 1), its layers' attention and dense FFN divided by tensor parallel, its
  experts divided by expert parallel, the (replicated) controller;
- model state (the data-parallel engine, Megatron-Core's distributed optimizer, parallel/dp_engine.py):
  fp32 weights and gradients (4 + 4 bytes; the gradients live in DDP's contiguous buffer, which
  the reduce-scatter works in), the two AdamW moments (8 bytes) divided over the data-parallel
  replicas (experts over the expert-data-parallel ones); bf16 autocast adds nothing persistent
  (the parameters stay fp32), but bf16 gradients (`grad_reduce_dtype=bf16`, which `plan` picks for
  a bf16 run) hold the matrices outside the routers as bf16 weights and gradients (2 + 2 bytes)
  with fp32 master shards (4 bytes) next to the moments, both divided over the replicas. The
  weights and the gradient buffer are whole on every replica (the parameter all-gather and the
  reduce-scatter work in them; at fp32 the optimizer's main shards are views of the weights, no
  copy); only the moments (and bf16 masters) shrink with replicas. Measured at the held-out shape,
  the live tensors between steps are exactly 16 bytes per parameter at data parallel 1;
- at the peak (the output layer's backward) the gradient buffer is live (the replicated engine
  freed its gradients before the forward, this one keeps the buffer), and autograd computes the
  output layer's whole weight gradient (V x d / tp, in the weight's dtype) before DDP's hook adds it
  into the buffer (no gradient-accumulation fusion): counted with the activations, not divided
  over replicas;
- activations kept for backward by the relaxed routed path, per token and layer
  `ACT_D * d + ACT_EXPERT * k * d_e + ACT_SCORES * H * T` values (attention and FFN parts divided
  by tensor parallel), the output layer's `ACT_LOGITS * V` per token, one micro-batch per
  pipeline stage in flight (1F1B keeps `pipeline` of them on the first stage); full recompute
  keeps one layer's activations plus every layer's input; expert parallel adds the all-to-all
  send and receive buffers (2 * k * d per token and layer).
The activation coefficients were measured (peak resident memory above the idle process, fp32,
CPU, local spec, three training steps) on seven small shapes spanning d 128-320, 2-6 layers,
sequence 128-512, micro-batch 4-16, FFN 256-768, and checked on two more; re-measured on six such
shapes once the routing path's kernels (9b7b382-0db2003 and the null swap margin's) kept fewer
values, where the estimate had drifted to 1.16-1.42x the live peak: `ACT_D` 22 -> 20 (1.13-1.39x);
`tests/training/test_planner.py` re-measures a shape none of them used and requires the estimate
to cover its peak and stay within 20 % above it. The
probe (tests/training/memory_probe.py) has freed blocks returned to the system, so it measures the
live peak a GPU's allocator would see, not glibc's per-thread heaps, which keep freed activations
(the distributed optimizer's collectives allocate on their own threads) and grow step after step.

Step time (`plan`): Dense's training FLOPs of a step (`metrics.training_flops_per_token` at the
dense cost) over the ranks' peak at Dense's MFU, times the system's step time over Dense's as
measured on a GPU (`STEP_RATIO`; a system not measured there is charged its FLOPs at the budget's
target instead, and the plan says so), times the pipeline bubble (1 + (pp - 1) / micro-batches),
times 4/3 under full recompute (one more forward), times 1 + TP_COST (tp - 1) for tensor
parallelism's all-reduces. The MFU and the ratios are measurements at one GPU's small shape
(`MEASURED_ON`), not of the cluster: `--mfu` replaces the MFU.
"""

from __future__ import annotations

import copy
import dataclasses

from ..routing.controller import controller_input_width
from ..routing.cost import expert_width
from ..routing.modes import N_MODES
from .config import ConfigError, RunConfig
from .metrics import training_flops_per_token

ACT_D = 20.0
"""d-wide values kept per token and layer (residual stream, norms, Q/K/V/O, the relaxed K/V writes)."""
ACT_EXPERT = 6.0
"""(k x expert width)-wide values per token and layer (SwiGLU intermediates of the selected experts)."""
ACT_SCORES = 0.05
"""Attention score values per token, head and key kept for backward (the fused softmax keeps few)."""
ACT_LOGITS = 3.5
"""Vocabulary-wide values per token at the output layer (logits, softmax and its gradient)."""
CONSTANT_BYTES = 16 * 2**20
"""Allocator and library buffers that do not scale with the model."""
GIB = 2**30
TP_COST = 0.08
"""Step-time overhead per extra tensor-parallel rank (two activation all-reduces per layer on
NVLink; an assumption of the estimate, not a measurement)."""


def _layout(run: RunConfig, world_size: int) -> tuple[int, int, int, int, int]:
    p = run.parallel
    dp = world_size // (p.tensor * p.pipeline)
    edp = max(1, dp * p.tensor // p.expert)
    return p.tensor, p.pipeline, p.expert, dp, edp


def estimate_rank_memory(run: RunConfig, world_size: int) -> dict[str, float]:
    """Memory of the most loaded rank (module docstring); GiB except `parameters_per_rank`."""
    m, r, t = run.triroute.model, run.triroute.router, run.train
    tp, pp, ep, dp, edp = _layout(run, world_size)
    layers = m.n_layers // pp
    attn = (m.d_model * (m.n_heads + 2 * m.n_kv_heads) * m.d_head + m.n_heads * m.d_head * m.d_model) / tp
    routed_experts = r.expert_routing
    if routed_experts:
        expert = r.num_experts / ep * 3 * m.d_model * expert_width(m, r)
        dense_ffn, k, d_e = 0.0, r.top_k, expert_width(m, r)
    else:
        expert, dense_ffn, k, d_e = 0.0, 3 * m.d_model * m.d_ff / tp, 1, m.d_ff
    d_in = controller_input_width(m.d_model, len(r.bits))
    controller = d_in * r.d_router + r.d_router**2 + r.d_router * (m.n_heads * N_MODES + r.num_experts + 1 + len(r.bits))
    embed_and_output = (2 if pp == 1 else 1) * m.vocab_size * m.d_model / tp
    dense_params = layers * (attn + dense_ffn + controller + 2 * m.d_model) + embed_and_output
    expert_params = layers * expert
    params = dense_params + expert_params
    bf16_masters = run.parallel.grad_reduce_dtype == "bf16"
    fp32_dense = layers * (controller + 2 * m.d_model) if bf16_masters else dense_params  # routers, gains

    def state_bytes(n: float, replicas: int, low: bool) -> float:
        return n * ((2 + 2 + 12 / replicas) if low else (8 + 8 / replicas))

    state = (state_bytes(fp32_dense, dp, False) + state_bytes(dense_params - fp32_dense, dp, True)
             + state_bytes(expert_params, edp, bf16_masters))

    bytes_per = 2 if t.dtype_name == "bf16" else 4
    tokens = t.micro_batch_size * m.seq_len
    per_layer = (ACT_D * m.d_model + ACT_EXPERT * k * d_e) / tp + ACT_SCORES * (m.n_heads / tp) * m.seq_len
    if ep > 1 and routed_experts:
        per_layer += 2 * k * m.d_model  # all-to-all send and receive buffers
    kept_layers = 1 if t.recompute else layers
    layer_inputs = layers * m.d_model if t.recompute else 0
    in_flight = pp  # 1F1B: the first stage holds `pp` micro-batches' activations
    activations = tokens * bytes_per * in_flight * (kept_layers * per_layer + layer_inputs)
    activations += tokens * 4 * ACT_LOGITS * m.vocab_size / tp  # fp32 loss path
    output_grad_bytes = 2 if bf16_masters else 4
    activations += output_grad_bytes * m.vocab_size * m.d_model / tp  # its weight gradient, before DDP's hook
    total = state + activations + CONSTANT_BYTES
    return {"parameters_per_rank": params, "model_state_gib": state / GIB, "activations_gib": activations / GIB,
            "total_gib": total / GIB}


MEASURED_ON = ("one H200, the 160m shape, micro-batch 16 x 2,048, bf16, local spec, 2026-11-28, commit b23e0fb "
               "(docs/gpu.md, sixth run)")
"""Where `DENSE_MFU` and `STEP_RATIO` were measured (`benchmarks/bench_train_step.py`)."""
DENSE_MFU = 0.20
"""Dense's model FLOPs utilisation there: 192-194 model TFLOP/s of a 989 TFLOP/s peak (194-201 over five
earlier machine starts)."""
STEP_RATIO = {"triroute": 1.76}
"""A system's training step time over Dense's on the same backbone there (TriRoute with its defaults, the
relaxed K/V write's values by the Triton kernel: the per-step median 1.76, and 1.69 in a second run on the
same machine; 1.85 with those values by the tensor chain, between the two). Systems not listed (Dense aside,
1 by definition) have not been measured on a GPU."""


def on_gpus(run: RunConfig) -> RunConfig:
    """The run as a GPU cluster trains it: `train.bf16` unset means bf16 there (fp32 on the CPU)."""
    return dataclasses.replace(run, train=dataclasses.replace(run.train, bf16=True)) if run.train.bf16 is None else run


@dataclasses.dataclass
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu_memory_gib: float = 80.0
    peak_tflops: float = 989.0
    """Dense bf16 peak per GPU (H100 SXM: 989)."""
    mfu: float = DENSE_MFU
    """Dense's model FLOPs utilisation for the step-time estimate (default: measured, `MEASURED_ON`)."""
    memory_headroom: float = 0.9
    """Fraction of GPU memory a layout may plan to use (the rest: CUDA context, fragmentation)."""

    def __post_init__(self) -> None:
        for name, ok, fix in (("nodes", self.nodes >= 1, "at least 1"), ("gpus_per_node", self.gpus_per_node >= 1, "at least 1"),
                              ("gpu_memory_gib", self.gpu_memory_gib > 0, "the GPU's memory in GiB, e.g. 80"),
                              ("peak_tflops", self.peak_tflops > 0, "the GPU's dense bf16 peak, e.g. 989"),
                              ("mfu", 0 < self.mfu <= 1, f"a fraction in (0, 1], e.g. {DENSE_MFU}")):
            if not ok:
                raise ConfigError(f"--{name.replace('_', '-')}={getattr(self, name)}: must be {fix}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclasses.dataclass
class Candidate:
    tensor: int
    pipeline: int
    expert: int
    micro_batch_size: int
    recompute: bool
    grad_reduce_dtype: str
    data_parallel: int
    memory: dict[str, float]
    step_seconds: float
    days: float

    @property
    def overrides(self) -> list[str]:
        """The key=value overrides that select this layout."""
        return [f"parallel.tensor={self.tensor}", f"parallel.pipeline={self.pipeline}",
                f"parallel.expert={self.expert}", f"train.micro_batch_size={self.micro_batch_size}",
                f"train.recompute={str(self.recompute).lower()}", f"parallel.grad_reduce_dtype={self.grad_reduce_dtype}"]


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def step_dense_flops(run: RunConfig) -> float:
    """Training FLOPs of one step at Dense's cost (the backbone every system shares)."""
    return training_flops_per_token(run.triroute, 1.0) * run.train.global_batch_size * run.triroute.model.seq_len


def step_ratio(run: RunConfig) -> tuple[float, str]:
    """(the system's step time over Dense's, where that figure comes from): measured on a GPU where
    it was (`STEP_RATIO`), else the FLOPs fraction at the budget's target."""
    if run.system == "dense":
        return 1.0, "Dense"
    if run.system in STEP_RATIO:
        return STEP_RATIO[run.system], f"{run.system} / Dense step time measured on {MEASURED_ON}"
    fraction = run.triroute.budget.flops_target if run.triroute.budget.enabled else 1.0
    flops = training_flops_per_token(run.triroute, fraction) / training_flops_per_token(run.triroute, 1.0)
    return flops, (f"{run.system} not measured on a GPU: its training FLOPs over Dense's"
                   f"{' at the budget target' if run.triroute.budget.enabled else ''}")


def plan(run: RunConfig, cluster: Cluster) -> list[Candidate]:
    """Every layout that validates and fits, fastest first (then least memory). Tensor and expert
    parallelism stay inside a node (their all-reduces and all-to-alls want NVLink). A bf16 run
    reduces its gradients in bf16 (half the bytes of both collectives, bf16 weights beside fp32
    master shards: Megatron's mixed precision)."""
    m, r, t = run.triroute.model, run.triroute.router, run.train
    reduce_dtype = "bf16" if t.dtype_name == "bf16" else run.parallel.grad_reduce_dtype
    world = cluster.world_size
    step_flops = step_dense_flops(run) * step_ratio(run)[0]
    experts = r.num_experts if r.expert_routing else 1
    out = []
    for tp in _divisors(m.n_kv_heads, cluster.gpus_per_node):
        for pp in _divisors(m.n_layers, 8):
            if world % (tp * pp):
                continue
            dp = world // (tp * pp)
            for ep in _divisors(experts, cluster.gpus_per_node):
                for mbs in (1, 2, 4, 8):
                    for recompute in (False, True):
                        cand = copy.deepcopy(run)
                        p = cand.parallel
                        p.tensor, p.pipeline, p.expert, p.grad_reduce_dtype = tp, pp, ep, reduce_dtype
                        cand.train.micro_batch_size, cand.train.recompute = mbs, recompute
                        try:
                            cand.validate(world)
                        except ConfigError:
                            continue
                        mem = estimate_rank_memory(cand, world)
                        if mem["total_gib"] > cluster.memory_headroom * cluster.gpu_memory_gib:
                            continue
                        n_micro = t.global_batch_size // (mbs * dp)
                        seconds = step_flops / (world * cluster.peak_tflops * 1e12 * cluster.mfu)
                        seconds *= (1 + (pp - 1) / n_micro) * (4 / 3 if recompute else 1.0) * (1 + TP_COST * (tp - 1))
                        out.append(Candidate(tp, pp, ep, mbs, recompute, reduce_dtype, dp, mem, seconds,
                                             seconds * t.steps / 86400))
    # Fastest first; among equals the most expert parallelism (the least expert state per rank),
    # then the largest micro-batch (better kernel efficiency, which the MFU figure does not model),
    # then the least memory.
    out.sort(key=lambda c: (round(c.step_seconds, 6), -c.expert, -c.micro_batch_size, c.memory["total_gib"]))
    return out


def format_plan(run: RunConfig, cluster: Cluster, candidates: list[Candidate], top: int = 8) -> str:
    m, t = run.triroute.model, run.train
    tokens_per_step = t.global_batch_size * m.seq_len
    lines = [f"recipe {run.name}: {t.steps:,} steps x {tokens_per_step:,} tokens = {t.steps * tokens_per_step / 1e9:.1f} B "
             f"tokens; cluster {cluster.nodes} x {cluster.gpus_per_node} GPUs, {cluster.gpu_memory_gib:g} GiB, "
             f"{cluster.peak_tflops:g} TFLOP/s peak at Dense's MFU {cluster.mfu:.0%}",
             "step time: Dense's at that MFU x {:.2f} ({})".format(*step_ratio(run))]
    if not candidates:
        lines.append("no layout fits: add nodes, use GPUs with more memory, or lower train.global_batch_size")
        return "\n".join(lines)
    lines.append("   TP  PP  EP  DP  micro recompute | params/rank  state GiB  activ GiB  total GiB | step s   days")
    for c in candidates[:top]:
        mem = c.memory
        lines.append(f"  {c.tensor:3d} {c.pipeline:3d} {c.expert:3d} {c.data_parallel:3d} {c.micro_batch_size:6d} "
                     f"{str(c.recompute):>9} | {mem['parameters_per_rank'] / 1e6:9.1f}M {mem['model_state_gib']:10.1f} "
                     f"{mem['activations_gib']:10.1f} {mem['total_gib']:10.1f} | {c.step_seconds:6.2f} {c.days:6.2f}")
    best = candidates[0]
    lines.append(f"pick: {' '.join(best.overrides)} -- the fastest estimated step that fits "
                 f"({best.memory['total_gib']:.1f} of {cluster.gpu_memory_gib:g} GiB); expert parallelism "
                 f"{best.expert} keeps 1/{best.expert} of the experts' weights and optimizer state per rank")
    return "\n".join(lines)
