"""Megatron-Core's distributed optimizer as the run's data-parallel engine
(`parallel.dp_engine=megatron_distopt`).

Megatron's `DistributedDataParallel` with ``use_distributed_optimizer=True`` reduce-scatters each
gradient bucket (during the backward with ``overlap_grad_reduce``), so every rank ends the step
holding the reduced gradient of its contiguous shard of the buffer only; Megatron's
`DistributedOptimizer` runs torch AdamW on those shards and all-gathers the updated parameters
(with ``overlap_param_gather``, bucket by bucket in the next forward's pre-hooks). Dense parameters
are sharded over the data-parallel group, DeepSpeed's expert parameters over the expert-data-
parallel group (Megatron's DDP and optimizer sort them by the same ``allreduce == False``).

`MegatronDistributedAdamW` is both the engine's `grad_sync` (begin / finish / discard, and the
global norm and clip, which must be taken from the shards: no rank holds a whole reduced
gradient) and its `optimizer` (step, param_groups for the LR schedule, the checkpoint protocol
of `checkpoint/sharded.py`). What it keeps of ours:

- the norm: each rank's shard sums of squares, split as `grad_reduce.norm_part` splits whole
  gradients, summed over the group the shards partition (dense: DP, experts: EDP), then
  `grad_reduce.norm_from_parts`: the same TP/EP/PP reductions as the other engines;
- the non-finite skip and the clip (``max / (norm + 1e-6)`` on the shards) stay the engine's;
  Megatron's own clip and loss scaling are off (`clip_grad=0`, fp32 parameters);
- weight decay on parameters of two or more dimensions only (ours), checked against Megatron's
  standard overrides group by group;
- checkpoints: whole per-parameter moments of the parameters `training/zero.owned_parameters`
  gives this rank, under the keys `ShardedAdamW` writes (gathered from the shards on save,
  re-sliced on load), so a run resumes at any layout and on either optimizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint.sharded import MOMENTS
from .devices import collective_device, module_device
from .grad_reduce import norm_from_parts, norm_part
from .megatron_ddp import MegatronGradSync, process_groups

if TYPE_CHECKING:
    from .groups import ParallelGroups


class ParamGroupsView(torch.optim.Optimizer):
    """The chained inner optimizers' param groups (the same dicts) as one torch optimizer, so one
    torch LR scheduler drives them all; its `step` only marks that the real step ran."""

    def __init__(self, param_groups: list[dict]):  # no super().__init__: it owns no parameter
        self.param_groups = param_groups
        self.defaults = {}
        self.state = {}

    def step(self, closure=None) -> None:  # the LR scheduler checks that it was called
        return None


class MegatronDistributedAdamW(MegatronGradSync):
    """Megatron-Core's DDP (reduce-scatter) and distributed AdamW over `model`.

    `named_groups` are the trainer's AdamW groups of (name, parameter) pairs with their
    ``weight_decay``; `lr`, `betas`, `eps` as torch AdamW takes them.
    """

    def __init__(self, model: nn.Module, named_groups: list[dict], groups: ParallelGroups, *, lr: float,
                 betas: tuple[float, float], eps: float, overlap_grad_reduce: bool = True,
                 overlap_param_gather: bool = False, bucket_size: int | None = None):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides

        from ..training.zero import owned_parameters

        super().__init__(model, groups, overlap_grad_reduce, bucket_size, use_distributed_optimizer=True,
                         overlap_param_gather=overlap_param_gather)
        decay = {id(p): spec["weight_decay"] for spec in named_groups for _, p in spec["params"]}
        config = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=max(decay.values(), default=0.0),
                                 adam_beta1=betas[0], adam_beta2=betas[1], adam_eps=eps, clip_grad=0.0,
                                 use_distributed_optimizer=True)
        chained = get_megatron_optimizer(config, [self.ddp], config_overrides=get_standard_config_overrides(config),
                                         use_gloo_process_groups=False, pg_collection=optimizer_process_groups(groups))
        self.inner = list(chained.chained_optimizers)
        self.chained = chained
        if any(group for opt in self.inner for group in opt.model_float16_groups):
            raise ValueError("parallel.dp_engine=megatron_distopt steps fp32 parameters only (its norm, clip and "
                             "checkpoint read the fp32 shards); this model has fp16/bf16 parameters. Fix: keep the "
                             "parameters fp32 and use train.bf16 (autocast) for bf16 compute")
        self.optimizer = ParamGroupsView([g for opt in self.inner for g in opt.optimizer.param_groups])
        self.param_groups = self.optimizer.param_groups
        _set_weight_decay(self.inner, decay)
        self._owned = owned_parameters(named_groups, groups)
        self._steps = 0
        """Successful optimizer steps (AdamW's step count), restored on resume."""

    def describe(self) -> str:
        mine = sum(s.numel() for opt in self.inner for group in opt.shard_fp32_groups for s in group)
        total = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        return (f"{super().describe()}; distributed optimizer: this rank updates {mine:,} of {total:,} parameters "
                f"(reduce-scatter, then all-gather; overlap_param_gather="
                f"{self.ddp.ddp_config.overlap_param_gather})")

    # -- grad_sync ------------------------------------------------------------------------
    def begin(self) -> None:
        super().begin()
        self.chained.zero_grad(set_to_none=True)

    def finish(self) -> None:
        self.ddp.finish_grad_sync()  # this rank's shard of every bucket now holds the reduced gradient
        self.chained.prepare_grads()  # shard parameters' .grad: views of those shards (no loss scaling)

    def grad_norm(self) -> float:
        parts = torch.zeros(3, dtype=torch.float64, device=module_device(self.model))
        for _, model_param, shard in self._shards():
            if shard.grad is not None:
                parts[norm_part(model_param)] += shard.grad.detach().double().pow(2).sum()
        parts = parts.to(collective_device())  # summed where the shards live, reduced where the backend can
        dense, expert = parts.clone(), parts.clone()
        dense[2], expert[:2] = 0.0, 0.0
        if self.groups.dp > 1:
            dist.all_reduce(dense, group=self.groups.dp_group)
        if self.groups.edp > 1:
            dist.all_reduce(expert, group=self.groups.edp_group)
        return norm_from_parts(dense + expert, self.groups)

    @torch.no_grad()
    def clip(self, norm: float, max_norm: float) -> None:
        if max_norm > 0 and norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for _, _, shard in self._shards():
                if shard.grad is not None:
                    shard.grad.mul_(scale)

    # -- optimizer --------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """AdamW on this rank's shards, then the parameter all-gather (or, with
        overlap_param_gather, its dispatch in the next forward)."""
        self.chained.step_with_ready_grads()
        self.optimizer.step()
        self._steps += 1

    def sync_params(self) -> None:
        """Finish any parameter all-gather still pending (overlap_param_gather): before parameters
        are read outside a forward (a checkpoint)."""
        if self.ddp.ddp_config.overlap_param_gather:
            self.ddp.start_param_sync(force_sync=True)

    def adam_step(self) -> int | None:
        return self._steps or None

    # -- the checkpoint protocol of checkpoint/sharded.py -------------------------------------
    def owned_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self._owned)

    def has_moments(self) -> bool:
        return self._steps > 0  # the same on every rank: owned_moments is collective

    def owned_moments(self) -> dict[str, dict[str, torch.Tensor]]:
        """Collective: whole moments of this rank's owned parameters, gathered from the shards
        (one all-reduce of a zero-filled flat buffer per inner optimizer and moment)."""
        owned = {id(p): n for n, p in self._owned}
        out: dict[str, dict[str, torch.Tensor]] = {}
        for opt in self.inner:
            params, offsets, total = _buffer_layout(opt)
            flat = torch.zeros(len(MOMENTS), total, dtype=torch.float32, device=collective_device())
            for model_groups, shard_groups in zip(opt.model_fp32_groups, opt.shard_fp32_groups):
                for p, shard in zip(model_groups, shard_groups):
                    r = opt._get_model_param_range_map(p)["param"]
                    state = opt.optimizer.state[shard]
                    for i, m in enumerate(MOMENTS):
                        flat[i, offsets[id(p)] + r.start: offsets[id(p)] + r.end] = state[m].detach().view(-1).to(flat.device)
            dist.all_reduce(flat, group=opt.data_parallel_group)
            for p in params:
                if id(p) in owned:
                    o = offsets[id(p)]
                    out[owned[id(p)]] = {m: flat[i, o: o + p.numel()].view_as(p).clone() for i, m in enumerate(MOMENTS)}
        return out

    def load_owned_moments(self, moments: dict[str, dict[str, torch.Tensor]], adam_step: int) -> None:
        """Collective: every rank brings its owned parameters' whole moments; each shard takes
        its slice (one all-reduce per inner optimizer, as in `owned_moments`)."""
        by_id = {id(p): moments[n] for n, p in self._owned}
        for opt in self.inner:
            params, offsets, total = _buffer_layout(opt)
            flat = torch.zeros(len(MOMENTS), total, dtype=torch.float32, device=collective_device())
            for p in params:
                if id(p) in by_id:
                    o = offsets[id(p)]
                    for i, m in enumerate(MOMENTS):
                        flat[i, o: o + p.numel()] = by_id[id(p)][m].reshape(-1).to(flat.device)
            dist.all_reduce(flat, group=opt.data_parallel_group)
            for model_groups, shard_groups in zip(opt.model_fp32_groups, opt.shard_fp32_groups):
                for p, shard in zip(model_groups, shard_groups):
                    r = opt._get_model_param_range_map(p)["param"]
                    o = offsets[id(p)]
                    opt.optimizer.state[shard] = {
                        "step": torch.tensor(float(adam_step), dtype=torch.float32),
                        **{m: flat[i, o + r.start: o + r.end].clone().to(shard.device) for i, m in enumerate(MOMENTS)},
                    }
        self._steps = int(adam_step)

    def load_state_dict(self, state_dicts) -> None:
        from ..checkpoint import CheckpointError

        raise CheckpointError("this checkpoint predates layout-independent checkpoints, which the distributed "
                              "optimizer needs. Fix: resume it once with parallel.dp_engine=replicated (its next "
                              "checkpoint is layout-independent), then switch to megatron_distopt.")

    def _shards(self):
        """(inner optimizer, model parameter, its shard parameter) over this rank's shards."""
        for opt in self.inner:
            for model_groups, shard_groups in zip(opt.model_fp32_groups, opt.shard_fp32_groups):
                for p, shard in zip(model_groups, shard_groups):
                    yield opt, p, shard


def optimizer_process_groups(groups: ParallelGroups):
    """`process_groups(groups)` plus what Megatron's optimizer factory asks for: the
    model-parallel and expert tensor-model-pipeline groups (for its rank bookkeeping) and the
    distributed-optimizer instance group (one instance: Megatron's own), from Megatron's parallel
    state, which `initialize_parallel` built with our layout."""
    from megatron.core import parallel_state

    collection = process_groups(groups)
    collection.mp = parallel_state.get_model_parallel_group()
    collection.tp_ep_pp = parallel_state.get_expert_tensor_model_pipeline_parallel_group()
    collection.intra_dist_opt = parallel_state.get_intra_distributed_optimizer_instance_group()
    return collection


def _buffer_layout(opt) -> tuple[list[nn.Parameter], dict[int, int], int]:
    """Every parameter of the gradient buffers `opt` steps (the same list on every rank of its
    group, whichever shard each rank holds), each one's offset in a flat concatenation, the total."""
    params = [p for buffer in opt.buffers for p in sorted(buffer.params, key=lambda q: buffer.param_index_map[q][0])]
    offsets, total = {}, 0
    for p in params:
        offsets[id(p)] = total
        total += p.numel()
    return params, offsets, total


def _set_weight_decay(inner: list, decay: dict[int, float]) -> None:
    """Each inner group's weight decay from the trainer's groups (decay on >= 2-D parameters);
    Megatron's standard overrides split the groups (wd_mult 0 for 1-D parameters and biases), and a
    group whose parameters the trainer decays differently is refused."""
    for opt in inner:
        for group, model_params in zip(opt.optimizer.param_groups, opt.model_fp32_groups):
            values = {decay[id(p)] for p in model_params}
            if len(values) > 1:
                raise ValueError(f"a Megatron optimizer group mixes weight decays {sorted(values)}: its standard "
                                 "overrides split parameters otherwise than the trainer (decay on >= 2-D tensors)")
            if values:
                group["weight_decay"] = values.pop()
            else:  # no parameter of this group in this rank's shard: Megatron's own value
                group["weight_decay"] = group["weight_decay"] * group.get("wd_mult", 1.0)
