"""Gradient synchronisation of a step: the flat all-reduce (`ReplicatedGradSync`, the step
engine's reduction for a plain torch optimizer, and the reference the data-parallel engine is
tested against), or Megatron-Core's `DistributedDataParallel` (contiguous gradient buffers,
buckets reduced during backward), the base of the run's engine (parallel/megatron_distopt.py).

The step engine holds one of these objects and calls ``begin`` before the forward-backward schedule,
``finish`` after it (before the norm) and ``discard`` when the step is skipped. After ``finish``
every parameter's ``p.grad`` holds the gradient of the global mean loss, as ``reduce_gradients``
defines it, so the norm, the clip and the optimizer read ``p.grad`` on either engine.

Megatron's DDP is given our groups explicitly (a ``ProcessGroupCollection``): dense parameters are
reduced over ``groups.dp_group``, DeepSpeed's expert parameters (``allreduce == False``, the
attribute Megatron's DDP also sorts by) over ``groups.edp_group``. With
``average_in_collective=False`` both kinds are pre-scaled by ``1 / dp`` and summed, which is exactly
``reduce_gradients``'s convention (experts: the EDP sum times ``1/dp``, not ``1/edp``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from torch import nn

from .grad_reduce import check_expert_group, clip_gradients, global_grad_norm, reduce_gradients

if TYPE_CHECKING:
    from .groups import ParallelGroups


class WholeGradients:
    """Norm and clip where every rank holds whole reduced gradients in `p.grad` (after `finish`)."""

    model: nn.Module
    groups: ParallelGroups

    def grad_norm(self) -> float:
        """The global gradient norm (every rank gets the same value)."""
        return global_grad_norm(self.model, self.groups)

    def clip(self, norm: float, max_norm: float) -> None:
        """Scale the gradients so the global norm `norm` is at most `max_norm` (0: no clipping)."""
        clip_gradients(self.model, norm, max_norm)


class ReplicatedGradSync(WholeGradients):
    """One flat all-reduce per (group, dtype) after the whole backward (`reduce_gradients`)."""

    def __init__(self, model: nn.Module, groups: ParallelGroups):
        self.model, self.groups = model, groups

    def describe(self) -> str:
        return "replicated gradient reduction: one flat all-reduce per group after the backward"

    def begin(self) -> None:
        for p in self.model.parameters():
            p.grad = None

    def finish(self) -> None:
        reduce_gradients(self.model, self.groups)

    def discard(self) -> None:
        self.begin()


def skip_world_of_one_collectives() -> bool:
    """Megatron's gradient buckets reduce-scatter gradients and all-gather parameters through two
    module globals of `param_and_grad_buffer`. In a group of one rank, this rank's shard is the
    whole bucket and both collectives are the identity, yet gloo still copies the whole buffer
    each time (about 0.1 s a call for a 90 M-parameter model on a CPU). Each global is wrapped once
    to return at once for a group of one whose shard is its buffer, and to call through otherwise.
    Returns whether the globals are wrapped (False: this Megatron-Core has no such globals)."""
    from megatron.core.distributed import param_and_grad_buffer as buffers

    names = ("dist_all_gather_func", "dist_reduce_scatter_func")
    if not all(hasattr(buffers, name) for name in names):
        return False
    for name in names:
        collective = getattr(buffers, name)
        if not getattr(collective, "skips_world_of_one", False):
            setattr(buffers, name, _unless_world_of_one(collective))
    return True


def _unless_world_of_one(collective):
    def call(output, input, *args, group=None, **kwargs):
        if (group is not None and group.size() == 1 and output.data_ptr() == input.data_ptr()
                and output.numel() == input.numel()):
            return None  # the identity: nothing to wait for (Megatron waits on its coalescing manager)
        return collective(output, input, *args, group=group, **kwargs)

    call.skips_world_of_one, call.__wrapped__ = True, collective
    return call


class MegatronGradSync(WholeGradients):
    """Megatron-Core's `DistributedDataParallel` around `model`, reducing into contiguous buffers.

    With ``overlap_grad_reduce`` each bucket's all-reduce is launched (asynchronously) by the
    backward hook of its last gradient; ``finish`` waits for them. Micro-batch accumulation: the
    schedule runs every micro-batch but the last inside ``config.no_sync_func`` (set here to the
    wrapper's ``no_sync``), so buckets are reduced once per step, during the last backward.
    """

    def __init__(self, model: nn.Module, groups: ParallelGroups, overlap_grad_reduce: bool = True,
                 bucket_size: int | None = None, *, use_distributed_optimizer: bool = False,
                 overlap_param_gather: bool = False, grad_reduce_in_fp32: bool = True):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        self.model, self.groups = model, groups
        for name, param in model.named_parameters():
            if getattr(param, "allreduce", True) is False:
                check_expert_group(name, param, groups)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=overlap_grad_reduce,
            use_distributed_optimizer=use_distributed_optimizer, overlap_param_gather=overlap_param_gather,
            average_in_collective=False, bucket_size=bucket_size,
        )
        skip_world_of_one_collectives()
        self.ddp = DistributedDataParallel(model.config, ddp_config, model,
                                           pg_collection=process_groups(groups))
        check_scaling(self.ddp, groups)
        model.config.no_sync_func = self.ddp.no_sync

    def describe(self) -> str:
        """One line for the log: buckets per group and whether they overlap the backward."""
        dense = sum(len(g.buckets) for g in self.ddp.bucket_groups)
        expert = sum(len(g.buckets) for g in self.ddp.expert_parallel_bucket_groups)
        dtypes = sorted({str(b.grad_dtype).removeprefix("torch.")
                         for b in (*self.ddp.buffers, *self.ddp.expert_parallel_buffers)})
        return (f"Megatron DDP: {dense} dense bucket(s) over the data-parallel group, {expert} expert bucket(s) "
                f"over the expert-data-parallel group, gradients in {'+'.join(dtypes)}, "
                f"overlap_grad_reduce={self.ddp.ddp_config.overlap_grad_reduce}")

    def begin(self) -> None:
        self.ddp.zero_grad_buffer()
        for p in self.model.parameters():
            p.grad = None

    def finish(self) -> None:
        self.ddp.finish_grad_sync()
        for p in self.ddp.params_with_grad:
            p.grad = p.main_grad  # a view of the reduced buffer: norm, clip and optimizer read p.grad

    def discard(self) -> None:
        self.begin()


def process_groups(groups: ParallelGroups):
    """Our groups as the `ProcessGroupCollection` Megatron's DDP takes (no context parallel:
    dp_cp is dp)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    collection = ProcessGroupCollection()
    collection.dp = collection.dp_cp = groups.dp_group
    collection.expt_dp = groups.edp_group
    collection.tp, collection.pp, collection.ep = groups.tp_group, groups.pp_group, groups.ep_group
    return collection


def check_scaling(ddp, groups: ParallelGroups) -> None:
    """Every bucket must be pre-scaled by exactly 1/dp (dense over DP, experts over EDP)."""
    for buffers in (ddp.buffers, ddp.expert_parallel_buffers):
        for buffer in buffers:
            for bucket in buffer.buckets:
                if not math.isclose(bucket.gradient_scaling_factor, 1.0 / groups.dp, rel_tol=1e-12):
                    raise RuntimeError(f"Megatron DDP pre-scales a bucket by {bucket.gradient_scaling_factor}, "
                                       f"expected 1/dp = 1/{groups.dp}: the library changed its convention")
