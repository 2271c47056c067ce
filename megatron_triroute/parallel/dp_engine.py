"""The run's data-parallel engine (`parallel.dp_engine`): every rule about it and its one builder.

One engine, `megatron_distopt`: Megatron-Core's `DistributedDataParallel` reduce-scatters the
gradient buckets (during the backward, `overlap_grad_reduce`) into Megatron-Core's
`DistributedOptimizer`, which steps each rank's shard and all-gathers the updated parameters
(during the next forward, `overlap_param_gather`); parallel/megatron_distopt.py. It runs on every
layout (TP, PP, EP, DP, DP 1 included) and on CPU (gloo) and GPU (NCCL) alike.

`check_dp_engine` holds every rule about the engine's options; `RunConfig.validate` calls it with
what the config knows of the precision (`train.bf16`, None: decided by the hardware), and
`build_dp_engine` again with the precision the run resolved. `build_dp_engine` returns the
trainer's (optimizer, grad_sync); docs/architecture.md says how to add an engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import _fail

if TYPE_CHECKING:
    from torch import nn

    from .groups import ParallelGroups

DP_ENGINES = ("megatron_distopt",)
"""`parallel.dp_engine` values, each built by `build_dp_engine`."""

RETIRED_DP_ENGINES = {
    "replicated": "its flat all-reduce and ZeRO-1 AdamW gave megatron_distopt's update (within 1e-6)",
    "megatron": "Megatron-Core's DDP with a ZeRO-1 AdamW moved megatron_distopt's bytes, holding more per rank",
}
"""Engines earlier runs named: a checkpoint written by one resumes on megatron_distopt (the same
whole-moment optimizer state), a new run naming one is refused with the fix."""

GRAD_REDUCE_DTYPES = ("fp32", "bf16")


def check_dp_engine(p, bf16: bool | None) -> None:
    """Refuse a `parallel` section (ParallelConfig) the engine cannot run, naming the fix. `bf16`:
    whether the forward runs under bf16 autocast (None: not known yet, decided by the hardware)."""
    if p.dp_engine in RETIRED_DP_ENGINES:
        _fail("parallel.dp_engine", p.dp_engine, f"was retired: {RETIRED_DP_ENGINES[p.dp_engine]}",
              "drop the override (megatron_distopt is the default; it resumes checkpoints written with "
              f"{p.dp_engine})")
    if p.dp_engine not in DP_ENGINES:
        _fail("parallel.dp_engine", p.dp_engine, "is not a data-parallel engine", f"use one of {', '.join(DP_ENGINES)}")
    if p.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
        _fail("parallel.grad_reduce_dtype", p.grad_reduce_dtype, "is not a reduction dtype", "use fp32 or bf16")
    if p.grad_reduce_dtype == "bf16" and bf16 is False:
        _fail("parallel.grad_reduce_dtype", p.grad_reduce_dtype,
              "makes the matrices bf16 parameters (fp32 master shards), which need the bf16 forward, and this run "
              "computes in fp32 (train.bf16 false, or unset without CUDA)",
              "set train.bf16=true, or parallel.grad_reduce_dtype=fp32")
    if p.bucket_mb < 0:
        _fail("parallel.bucket_mb", p.bucket_mb, "must be >= 0", "use 0 for Megatron's default bucket size")


def adamw_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's groups (Appendix B) as (name, parameter) pairs: weight decay on matrices only, none
    on norms, biases and gains."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (decay if param.dim() >= 2 else no_decay).append((name, param))
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_dp_engine(model: nn.Module, run, groups: ParallelGroups):
    """(optimizer, grad_sync) of `run`'s engine (a RunConfig) over this rank's `model`: the
    optimizer steps (and checkpoints) the parameters; grad_sync reduces the gradients each step
    (begin / finish / discard), takes the global norm and clips (training/engine.py)."""
    from .megatron_distopt import MegatronDistributedAdamW

    p, o = run.parallel, run.optim
    check_dp_engine(p, run.train.dtype_name == "bf16")
    bucket = int(p.bucket_mb * 2**20 / 4) if p.bucket_mb > 0 else None  # elements of fp32 gradient
    optimizer = MegatronDistributedAdamW(model, adamw_groups(model, o.weight_decay), groups, lr=o.lr,
                                         betas=(o.beta1, o.beta2), eps=o.eps, overlap_grad_reduce=p.overlap_grad_reduce,
                                         overlap_param_gather=p.overlap_param_gather, bucket_size=bucket,
                                         bf16=p.grad_reduce_dtype == "bf16")
    return optimizer, optimizer  # the distributed optimizer reduces its own gradients
