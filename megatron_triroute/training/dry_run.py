"""`--dry-run`: validate a recipe against a world size and estimate memory per rank, no training
(the estimate: planner.estimate_rank_memory)."""

from __future__ import annotations

from .config import RunConfig
from .planner import estimate_rank_memory, on_gpus


def dry_run(run: RunConfig, world_size: int) -> int:
    run.validate(world_size)
    p = run.parallel
    dp = world_size // (p.tensor * p.pipeline)
    n_micro = run.train.global_batch_size // (run.train.micro_batch_size * dp)
    gpu = on_gpus(run)
    est = estimate_rank_memory(gpu, world_size)
    print(run.to_json())
    print(f"layout: world {world_size} = tensor {p.tensor} x pipeline {p.pipeline} x data {dp}; "
          f"expert parallel {p.expert} (expert-data {dp * p.tensor // p.expert})")
    print(f"batch: global {run.train.global_batch_size} sequences = {dp} data-parallel x {n_micro} micro-batches "
          f"x {run.train.micro_batch_size}; steps {run.train.steps}")
    print(f"memory estimate per rank ({gpu.train.dtype_name}): " + ", ".join(
        f"{k} {v:,.2f}" if isinstance(v, float) else f"{k} {v:,}" for k, v in est.items()))
    print("dry run OK: the recipe is valid for this world size")
    return 0
