"""`--dry-run`: validate a recipe against a world size and estimate memory per rank, no training.

The estimate is analytic (ours): parameters on the most loaded rank (pipeline stage with the
embedding or the output layer; experts divided by expert parallel; attention and dense FFN by
tensor parallel), times bytes for weights, gradients and AdamW state, plus activations of one
micro-batch with the relaxed routed attention (two T x T score maps per head) kept for backward.
"""

from __future__ import annotations

from ..routing.cost import expert_width
from .config import RunConfig


def estimate_rank_memory(run: RunConfig, world_size: int) -> dict[str, float]:
    m, r, p, t = run.triroute.model, run.triroute.router, run.parallel, run.train
    bf16 = t.dtype_name == "bf16"
    layers = m.n_layers // p.pipeline
    attn = (m.d_model * (m.n_heads + 2 * m.n_kv_heads) * m.d_head + m.n_heads * m.d_head * m.d_model) / p.tensor
    if r.expert_routing:
        ffn = r.num_experts / p.expert * 3 * m.d_model * expert_width(m, r)
    else:
        ffn = 3 * m.d_model * m.d_ff / p.tensor
    d_in = m.d_model + 3 + 4 + len(r.bits)
    controller = d_in * r.d_router + r.d_router**2 + r.d_router * (m.n_heads * 3 + r.num_experts + 1 + len(r.bits))
    embed = m.vocab_size * m.d_model / p.tensor
    params = layers * (attn + ffn + controller + 2 * m.d_model) + embed
    # fp32 master weights + grads + two AdamW moments (+ a bf16 working copy when training in bf16).
    state_bytes = params * (4 + 4 + 8 + (2 if bf16 else 0))
    act_bytes_per = 2 if bf16 else 4
    T, B = m.seq_len, t.micro_batch_size
    per_layer = B * T * m.d_model * 16 + 2 * B * (m.n_heads // p.tensor) * T * T * 2
    in_flight = p.pipeline if p.pipeline > 1 else 1  # 1F1B keeps up to `pp` micro-batches alive
    activations = (layers if not t.recompute else 1) * per_layer * act_bytes_per * in_flight
    gib = 2**30
    return {"parameters_per_rank": params, "weights_grads_optimizer_gib": state_bytes / gib,
            "activations_gib": activations / gib, "total_gib": (state_bytes + activations) / gib}


def dry_run(run: RunConfig, world_size: int) -> int:
    run.validate(world_size)
    p = run.parallel
    dp = world_size // (p.tensor * p.pipeline)
    n_micro = run.train.global_batch_size // (run.train.micro_batch_size * dp)
    est = estimate_rank_memory(run, world_size)
    print(run.to_json())
    print(f"layout: world {world_size} = tensor {p.tensor} x pipeline {p.pipeline} x data {dp}; "
          f"expert parallel {p.expert} (expert-data {dp * p.tensor // p.expert})")
    print(f"batch: global {run.train.global_batch_size} sequences = {dp} data-parallel x {n_micro} micro-batches "
          f"x {run.train.micro_batch_size}; steps {run.train.steps}")
    print("memory estimate per rank: " + ", ".join(
        f"{k} {v:,.2f}" if isinstance(v, float) else f"{k} {v:,}" for k, v in est.items()))
    print("dry run OK: the recipe is valid for this world size")
    return 0
