"""Data-parallel gradient reduction for a plain torch optimizer (no DeepSpeed engine, no Megatron DDP)."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .devices import collective_device, module_device

if TYPE_CHECKING:
    from megatron_triroute.parallel.groups import ParallelGroups


def reduce_gradients(model: nn.Module, groups: ParallelGroups) -> None:
    """Turn each rank's local gradients into the gradient of the global mean loss, in place.

    Call after ``loss.backward()`` and before ``optimizer.step()``; every rank must call it.

    Convention: each data-parallel replica ``r`` (``dp`` of them) computes ``L_r``, the mean loss over
    its own micro-batch, and the global loss is ``L = (1/dp) * sum_r L_r``.

    Dense parameters are replicated on every replica and rank ``r`` holds ``dL_r/dw``, so
    ``dL/dw = (1/dp) * sum_r dL_r/dw``: an all-reduce SUM over the data-parallel group, times ``1/dp``
    (an average). Megatron-Core 0.16.1's data-parallel group spans the expert dimension: it holds every
    rank with the same tensor/pipeline position, ``dp = world / (tp * pp)``.

    Expert parameters (``allreduce == False``, set by DeepSpeed's ``Experts``) live on one rank of
    each expert-parallel group. The all-to-all in the forward brought that rank the tokens of every
    replica in its expert-parallel group, and its backward returned their gradients, so after
    ``backward`` the rank already holds ``sum_{r in its EP group} dL_r/dw_e``. The copies of the same
    expert in the other expert-parallel groups hold the sums for their replicas, and those copies
    form the expert-data-parallel group. Hence ``dL/dw_e = (1/dp) * sum over EDP of the local grads``:
    an all-reduce SUM over the expert-data-parallel group only (reducing over the full data-parallel
    group would add other experts' gradients), scaled by ``1/dp``, not ``1/edp``: dividing by
    ``edp = dp * tp / ep`` would be off by a factor ``ep / tp``. (With tensor parallel, DeepSpeed's
    ``MOELayer`` gives each tensor-parallel rank a disjoint slice of its replica's tokens, so the
    tensor-parallel ranks' expert grads are partial sums that the same EDP sum completes.) This is
    the scaling DeepSpeed's engine (``_reduce_expert_gradients``) and Megatron's DDP use.

    Gradients are reduced in one flat buffer per (group, dtype). A parameter that requires grad
    but got none is given a zero gradient first, so every rank reduces buffers of the same layout.
    Tensor-parallel reductions (sequence-parallel norms, pipeline-tied embeddings) are not done here.
    """
    dense: list[torch.Tensor] = []
    expert: list[torch.Tensor] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        if getattr(param, "allreduce", True):
            dense.append(param.grad)
        else:
            check_expert_group(name, param, groups)
            expert.append(param.grad)
    scale = 1.0 / groups.dp
    _all_reduce_coalesced(dense, groups.dp_group, scale)
    _all_reduce_coalesced(expert, groups.edp_group, scale)


def check_expert_group(name: str, param: torch.Tensor, groups: ParallelGroups) -> None:
    """An expert parameter must belong to the run's DeepSpeed expert group: it is reduced over
    that layout's expert-data-parallel group."""
    group_name = getattr(param, "group_name", None)
    if group_name != groups.ep_group_name:
        raise ValueError(
            f"expert parameter {name} belongs to DeepSpeed expert group {group_name!r} but the run's "
            f"groups are {groups.ep_group_name!r}; build expert layers with the same ParallelGroups"
        )


def _all_reduce_coalesced(grads: Iterable[torch.Tensor], group, scale: float) -> None:
    """Sum ``grads`` over ``group`` and multiply by ``scale``, one flat buffer per dtype/device."""
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        buckets[(grad.dtype, grad.device)].append(grad)
    reduce = dist.get_world_size(group) > 1
    for bucket in buckets.values():
        flat = _flatten_dense_tensors(bucket)
        if reduce:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        if scale != 1.0:
            flat.mul_(scale)
        for grad, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            grad.copy_(reduced)


def global_grad_norm(model: nn.Module, groups: ParallelGroups) -> float:
    """Global gradient L2 norm over every parameter once: tensor-parallel shards sum over TP,
    replicated (non-TP) dense parameters count once, experts sum over the expert-parallel group,
    and all of it sums over pipeline stages. Call after `reduce_gradients` (replicas agree)."""
    graded = [(p, p.grad) for p in model.parameters() if p.grad is not None]
    return norm_from_parts(norm_parts(graded, module_device(model)), groups)


NORM_CHUNK = 1 << 16
"""Elements per piece of the fp64 norm on a CPU: there each piece is converted to fp64 whole before
its norm, so a large gradient in one piece streams its fp64 copy through memory; pieces of 2^16 stay
in cache (six 25 MB gradients: 14 ms against 94, one thread). A GPU's multi-tensor norm takes the
gradients whole."""

NORM_SPLIT = 4 * NORM_CHUNK
"""A CPU gradient is cut into NORM_CHUNK pieces only from this many elements: below it the fp64 copy
(at most 2 MB) stays in the outer caches whole, and the cut's two ops a tensor buy nothing."""


def norm_parts(graded: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """This rank's sums of squares [tp-sharded, replicated, expert] (fp64, on `device`) of the
    gradients in `graded`, (parameter, its gradient or gradient shard) pairs, each added to its
    parameter's `norm_part`: one multi-tensor fp64 norm per part, not a chain of ops per tensor."""
    by_part: list[list[torch.Tensor]] = [[], [], []]
    for param, grad in graded:
        pieces = grad.reshape(-1).split(NORM_CHUNK) if grad.device.type == "cpu" and grad.numel() > NORM_SPLIT else (grad,)
        by_part[norm_part(param)].extend(pieces)
    sums = [torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)).to(device).square().sum()
            if grads else torch.zeros((), dtype=torch.float64, device=device) for grads in by_part]
    return torch.stack(sums)


def norm_part(param: torch.Tensor) -> int:
    """Which sum of squares a parameter's gradient adds to: 0 tensor-parallel shard, 1 replicated
    dense, 2 expert."""
    if getattr(param, "allreduce", True) is False:
        return 2
    return 0 if getattr(param, "tensor_model_parallel", False) else 1


def norm_from_parts(parts: torch.Tensor, groups: ParallelGroups) -> float:
    """The global norm from this rank's sums of squares [tp-sharded, replicated, expert] (each over
    whole data-parallel replicas): TP shards summed over TP, experts over EP, then over stages."""
    parts = parts.to(collective_device())  # summed where the gradients live, reduced where the backend can
    sharded = parts[0:1].clone()
    if groups.tp > 1:
        dist.all_reduce(sharded, group=groups.tp_group)
    expert = parts[2:3].clone()
    if groups.ep > 1:
        dist.all_reduce(expert, group=groups.ep_group)
    total = sharded + parts[1:2] + expert
    if groups.pp > 1:
        dist.all_reduce(total, group=groups.pp_group)
    return total.sqrt().item()


@torch.no_grad()
def clip_gradients(model: nn.Module, norm: float, max_norm: float) -> None:
    """Scale every gradient so the global norm `norm` is at most `max_norm` (0 = no clipping)."""
    if max_norm > 0 and norm > max_norm:
        scale_gradients([p.grad for p in model.parameters() if p.grad is not None], max_norm / (norm + 1e-6))


@torch.no_grad()
def scale_gradients(grads: list[torch.Tensor], scale: float) -> None:
    """Multiply every tensor of `grads` by `scale` in place (one multi-tensor op per device and dtype)."""
    if grads:
        torch._foreach_mul_(grads, scale)
