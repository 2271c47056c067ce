"""Megatron-Core's distributed optimizer: the run's data-parallel engine
(`parallel.dp_engine=megatron_distopt`, built by parallel/dp_engine.py).

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
- checkpoints: whole per-parameter moments of the parameters `ownership.owned_parameters`
  gives this rank (gathered from the shards on save, re-sliced on load), so a run resumes at any
  layout; checkpoints of the per-rank format (name-keyed whole moments) load too.

With ``bf16=True`` (`parallel.grad_reduce_dtype=bf16`) this is Megatron's mixed-precision
recipe: the backbone's and experts' matrices (`low_precision_parameters`) become bf16, so their
gradient buckets are bf16 and are reduce-scattered in bf16, and the updated parameters are
all-gathered in bf16 (half the bytes of each collective); Megatron's optimizer keeps an fp32
master copy of each rank's shard, which AdamW steps. The routers and the 1-D gains stay fp32
(the router computes in fp32). Checkpoints hold the fp32 masters (`master_parameters`), so they
are the same format as an fp32 run's and a resume continues from the exact masters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint.sharded import LOW_PRECISION, MOMENTS
from .devices import collective_device, module_device
from .grad_reduce import norm_from_parts, norm_parts, scale_gradients
from .megatron_ddp import MegatronGradSync, process_groups
from .ownership import owned_parameters

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


def low_precision_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters a bf16-gradient run holds in bf16: every matrix (>= 2-D) of the backbone and
    the experts. The routing modules' parameters (controllers, MoD routers) stay fp32, as their
    computation does, and so do the 1-D gains and biases (a negligible share of the bytes)."""
    from .. import routing

    in_router = {id(p) for m in model.modules() if type(m).__module__.startswith(routing.__name__ + ".")
                 for p in m.parameters()}
    return [(n, p) for n, p in model.named_parameters() if p.dim() >= 2 and id(p) not in in_router]


class MegatronDistributedAdamW(MegatronGradSync):
    """Megatron-Core's DDP (reduce-scatter) and distributed AdamW over `model`.

    `named_groups` are the trainer's AdamW groups of (name, parameter) pairs with their
    ``weight_decay``; `lr`, `betas`, `eps` as torch AdamW takes them. `bf16`: turn
    `low_precision_parameters(model)` to bf16 (bf16 gradient buckets and parameter all-gathers,
    fp32 master shards); the model must then run its forward under bf16 autocast.
    """

    def __init__(self, model: nn.Module, named_groups: list[dict], groups: ParallelGroups, *, lr: float,
                 betas: tuple[float, float], eps: float, overlap_grad_reduce: bool = True,
                 overlap_param_gather: bool = False, bucket_size: int | None = None, bf16: bool = False):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides

        if not bf16 and any(p.dtype != torch.float32 for p in model.parameters()):
            raise ValueError("parallel.dp_engine=megatron_distopt with fp32 gradients steps fp32 parameters (its "
                             "norm, clip and checkpoint read fp32 shards); this model has fp16/bf16 parameters. "
                             "Fix: keep the parameters fp32 (train.bf16 runs the forward under autocast), or set "
                             "parallel.grad_reduce_dtype=bf16 for bf16 parameters with fp32 master shards")
        if bf16:
            for _, param in low_precision_parameters(model):
                param.data = param.data.to(torch.bfloat16)
        super().__init__(model, groups, overlap_grad_reduce, bucket_size, use_distributed_optimizer=True,
                         overlap_param_gather=overlap_param_gather, grad_reduce_in_fp32=not bf16)
        decay = {id(p): spec["weight_decay"] for spec in named_groups for _, p in spec["params"]}
        config = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=max(decay.values(), default=0.0),
                                 adam_beta1=betas[0], adam_beta2=betas[1], adam_eps=eps, clip_grad=0.0,
                                 use_distributed_optimizer=True, bf16=bf16)
        chained = get_megatron_optimizer(config, [self.ddp], config_overrides=get_standard_config_overrides(config),
                                         use_gloo_process_groups=False, pg_collection=optimizer_process_groups(groups))
        self.inner = list(chained.chained_optimizers)
        for opt in self.inner:
            fuse_adamw(opt.optimizer)
            skip_aliased_param_copy(opt)
        self.chained = chained
        self.optimizer = ParamGroupsView([g for opt in self.inner for g in opt.optimizer.param_groups])
        self.param_groups = self.optimizer.param_groups
        _set_weight_decay(self.inner, decay)
        self._owned = owned_parameters(named_groups, groups)
        self._steps = 0
        """Successful optimizer steps (AdamW's step count), restored on resume."""

    def describe(self) -> str:
        mine = sum(shard.numel() for _, _, shard in self._shards())
        total = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        low = sum(p.numel() for p in self.model.parameters() if p.dtype == torch.bfloat16)
        masters = f"; {low:,} bf16 parameters, stepped as fp32 master shards" if low else ""
        return (f"{super().describe()}; distributed optimizer: this rank updates {mine:,} of {total:,} parameters "
                f"(reduce-scatter, then all-gather; overlap_param_gather="
                f"{self.ddp.ddp_config.overlap_param_gather}){masters}")

    # -- grad_sync ------------------------------------------------------------------------
    def begin(self) -> None:
        super().begin()
        self.chained.zero_grad(set_to_none=True)

    def finish(self) -> None:
        self.ddp.finish_grad_sync()  # this rank's shard of every bucket now holds the reduced gradient
        self.chained.prepare_grads()  # shard parameters' .grad: views of those shards (no loss scaling)

    def grad_norm(self) -> float:
        graded = [(model_param, shard.grad) for _, model_param, shard in self._shards() if shard.grad is not None]
        parts = norm_parts(graded, module_device(self.model))
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
            scale_gradients([shard.grad for _, _, shard in self._shards() if shard.grad is not None],
                            max_norm / (norm + 1e-6))

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
        """Collective: whole moments of this rank's owned parameters, gathered from the shards."""
        owned = {id(p): n for n, p in self._owned}
        out: dict[str, dict[str, torch.Tensor]] = {}
        for opt in self.inner:
            whole = _whole_from_shards(opt, lambda shard: [opt.optimizer.state[shard][m] for m in MOMENTS],
                                       rows=len(MOMENTS), wanted=owned)
            for key, rows in whole.items():
                out[owned[key]] = dict(zip(MOMENTS, rows))
        return out

    def load_owned_moments(self, moments: dict[str, dict[str, torch.Tensor]], adam_step: int) -> None:
        """Collective: every rank brings its owned parameters' whole moments; each shard takes
        its slice."""
        by_id = {id(p): [moments[n][m] for m in MOMENTS] for n, p in self._owned}
        for opt in self.inner:
            for shard, rows in _shards_from_whole(opt, by_id, rows=len(MOMENTS)):
                opt.optimizer.state[shard] = {"step": torch.tensor(float(adam_step), dtype=torch.float32),
                                              **{m: row.to(shard.device) for m, row in zip(MOMENTS, rows)}}
        self._steps = int(adam_step)

    def master_parameters(self) -> dict[int, torch.Tensor]:
        """Collective: {id(bf16 parameter): its whole fp32 master}, gathered from the ranks' master
        shards: what a checkpoint stores for it. Empty without bf16 parameters (the fp32 parameters
        are their own masters)."""
        low = {id(p): p for p in self.model.parameters() if p.dtype in LOW_PRECISION}
        out: dict[int, torch.Tensor] = {}
        for opt in self.inner if low else ():  # every inner optimizer on every rank: collective
            got = _whole_from_shards(opt, lambda shard: [shard], rows=1, wanted=low)
            out.update({key: rows[0].to(low[key].device) for key, rows in got.items()})
        return out

    @torch.no_grad()
    def load_master_parameters(self, values: dict[int, torch.Tensor]) -> None:
        """Each master shard of a bf16 parameter takes its slice of the parameter's whole fp32 value
        in `values` (by parameter id; every rank brings its own parameters': a checkpoint's)."""
        for opt in self.inner:
            for shard, rows in _shards_from_whole(opt, {k: [v] for k, v in values.items()}, rows=1, broadcast=False):
                shard.copy_(rows[0])

    def load_state_dict(self, state_dicts) -> None:
        """Collective: restore a per-rank format checkpoint's optimizer states (written before
        layout-independent checkpoints: {"state": {parameter name: {"step", "exp_avg",
        "exp_avg_sq"}}, "param_groups": [...]}, whole moments of the parameters that rank owned),
        each owned parameter's taken from whichever of `state_dicts` holds it. The learning rate
        comes from the first one's groups."""
        merged: dict[str, dict] = {}
        state_dicts = list(state_dicts)
        for sd in state_dicts:
            merged.update(sd["state"])
        missing = [n for n, _ in self._owned if n not in merged]
        if missing and merged:
            raise KeyError(f"optimizer state missing for parameters {missing[:5]}: the checkpoint does not "
                           "match this model")
        steps = torch.tensor([max((int(s["step"]) for s in merged.values() if "step" in s), default=0)],
                             dtype=torch.float64, device=collective_device())
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)  # a rank owning nothing still joins the collectives
        if int(steps.item()) == 0:
            return  # written before the first step: no moments yet
        self.load_owned_moments({n: {m: merged[n][m] for m in MOMENTS} for n, _ in self._owned}, int(steps.item()))
        for group in self.param_groups:
            group["lr"] = state_dicts[0]["param_groups"][0]["lr"]

    def _shards(self):
        """(inner optimizer, model parameter, its fp32 shard) over this rank's shards."""
        for opt in self.inner:
            for p, shard in _main_shards(opt):
                yield opt, p, shard


def fuse_adamw(optimizer: torch.optim.Optimizer) -> bool:
    """Step torch's Adam/AdamW (Megatron-Core's optimizer where neither Transformer Engine nor Apex
    is installed) with torch's fused kernel when every parameter is on the CPU or every one on a CUDA
    device: one `_fused_adamw_` per parameter group, with the step counts kept as tensors. torch's
    defaults are a loop over the parameters on the CPU (about ten ops and one host read of the step
    count each) and the multi-tensor path on CUDA (a dozen launches per group and a host read of
    each step count). The update is AdamW's to rounding. Returns whether it switched; any other
    optimizer, a differentiable or explicitly multi-tensor one, or parameters on other devices are
    left as they are."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    params = [p for group in optimizer.param_groups for p in group["params"]]
    kinds = {p.device.type for p in params}
    if not params or len(kinds) != 1 or kinds.pop() not in ("cpu", "cuda"):
        return False
    if any(group.get("differentiable") or group.get("foreach") for group in optimizer.param_groups):
        return False
    for group in optimizer.param_groups:
        group["fused"] = True
    optimizer.defaults["fused"] = True
    optimizer._step_supports_amp_scaling = True  # as torch's constructor sets it for fused=True
    return True


def skip_aliased_param_copy(opt) -> bool:
    """Megatron-Core's `DistributedOptimizer` moves every fp32 shard between its buffers and the
    parameters AdamW steps with a view, a slice and a copy per parameter tensor, each step, where
    for fp32 parameters (no bf16/fp16 masters, no FP8) the memory never moves:

    - after the step, `_copy_main_params_to_model_params` copies each updated shard into the
      parameter buffer, but the shard is a view of that very buffer slot (Megatron builds it as
      ``model_param.view(-1)[range]`` and the parameter lives in the buffer): each value is written
      onto itself. Each step checks on the host (no tensor op) that every shard still is its slot
      and then skips the copy; otherwise Megatron's copy runs.
    - before it, `_copy_model_grads_to_main_grads` sets each shard's ``.grad`` to a fresh view of
      its slice of the fp32 gradient buffer. The view is kept and set again while it still is that
      slice of the parameter's ``main_grad`` (checked on the host).

    Returns whether the shortcuts are installed."""
    if (opt.is_stub_optimizer or opt.ddp_config.use_megatron_fsdp or any(opt.model_float16_groups)
            or any(opt._get_fp8_params_and_shard_fp32_from_fp8()) or opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8):
        return False
    megatron_copy = opt._copy_main_params_to_model_params
    pairs = lambda: ((model_param, shard) for model_group, shard_group in zip(opt.model_fp32_groups, opt.shard_fp32_groups)
                     for model_param, shard in zip(model_group, shard_group))

    def copy_unless_aliased() -> None:
        if not all(_is_buffer_slot(opt, model_param, shard) for model_param, shard in pairs()):
            megatron_copy()

    views: dict[int, torch.Tensor] = {}

    def set_shard_grads() -> None:
        for model_param, shard in pairs():
            param_range = opt._get_model_param_range_map(model_param)["param"]
            grad, view = model_param.main_grad, views.get(id(shard))
            if view is None or not _is_slice_of(view, grad, param_range.start, shard.numel()):
                view = grad.view(-1)[param_range.start : param_range.end].float()
                views[id(shard)] = view
            shard.grad = view

    opt._copy_main_params_to_model_params = copy_unless_aliased
    opt._copy_model_grads_to_main_grads = set_shard_grads
    return True


def _is_slice_of(view: torch.Tensor, whole: torch.Tensor, start: int, numel: int) -> bool:
    """Whether `view` is elements start .. start + numel of the contiguous fp32 `whole`, in its storage."""
    return (view.dtype == whole.dtype == torch.float32 and whole.is_contiguous() and view.numel() == numel
            and view.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
            and view.data_ptr() == whole.data_ptr() + start * whole.element_size())


def _is_buffer_slot(opt, model_param: nn.Parameter, shard: torch.Tensor) -> bool:
    """Whether `shard` is the very memory `_copy_main_params_to_model_params` would copy it into."""
    world_range = opt._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
    gbuf_index, _, bucket_id = opt.model_param_gbuf_map[model_param]
    slot = opt.buffers[gbuf_index].buckets[bucket_id].param_data
    return (shard.dtype == slot.dtype and shard.numel() == world_range.size and shard.is_contiguous()
            and shard.data_ptr() == slot.data_ptr() + world_range.start * slot.element_size())


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


def _main_shards(opt) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
    """(model parameter, the fp32 shard AdamW steps) over one inner optimizer's shards on this
    rank: views of fp32 parameters, master copies of bf16 ones."""
    for model_groups, shard_groups in ((opt.model_float16_groups, opt.shard_fp32_from_float16_groups),
                                       (opt.model_fp32_groups, opt.shard_fp32_groups)):
        for model_group, shard_group in zip(model_groups, shard_groups):
            yield from zip(model_group, shard_group)


def _whole_from_shards(opt, values: Callable[[torch.Tensor], list[torch.Tensor]], *, rows: int,
                       wanted: dict[int, object]) -> dict[int, list[torch.Tensor]]:
    """Collective over `opt`'s group: each rank writes `values(shard)` (`rows` tensors of the
    shard's size) at its shard's place in a zero-filled flat fp32 buffer of every parameter the
    optimizer steps; one all-reduce makes them whole. Returns, for the parameters whose id is in
    `wanted`, their whole rows (each of the parameter's shape)."""
    params, offsets, total = _buffer_layout(opt)
    flat = torch.zeros(rows, total, dtype=torch.float32, device=collective_device())
    for p, shard in _main_shards(opt):
        r = opt._get_model_param_range_map(p)["param"]
        at = offsets[id(p)]
        for i, value in enumerate(values(shard)):
            flat[i, at + r.start: at + r.end] = value.detach().view(-1).to(flat.device)
    dist.all_reduce(flat, group=opt.data_parallel_group)
    return {id(p): [flat[i, offsets[id(p)]: offsets[id(p)] + p.numel()].view_as(p).clone() for i in range(rows)]
            for p in params if id(p) in wanted}


def _shards_from_whole(opt, whole: dict[int, list[torch.Tensor]], *, rows: int,
                       broadcast: bool = True) -> Iterator[tuple[torch.Tensor, list[torch.Tensor]]]:
    """The reverse of `_whole_from_shards`: (shard, its slice of each of the `rows` whole
    tensors) for this rank's shards of `opt`. With `broadcast` (collective) each parameter's whole
    tensors need only be on one rank of the group (its owner: one all-reduce spreads them);
    without it every rank brings every parameter's."""
    params, offsets, total = _buffer_layout(opt)
    if broadcast:
        flat = torch.zeros(rows, total, dtype=torch.float32, device=collective_device())
        for p in params:
            if id(p) in whole:
                at = offsets[id(p)]
                for i, value in enumerate(whole[id(p)]):
                    flat[i, at: at + p.numel()] = value.reshape(-1).to(flat.device)
        dist.all_reduce(flat, group=opt.data_parallel_group)
        whole = {id(p): [flat[i, offsets[id(p)]: offsets[id(p)] + p.numel()] for i in range(rows)] for p in params}
    for p, shard in _main_shards(opt):
        if id(p) in whole:
            r = opt._get_model_param_range_map(p)["param"]
            yield shard, [value.reshape(-1)[r.start: r.end].clone() for value in whole[id(p)]]


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
        for group, low, full in zip(opt.optimizer.param_groups, opt.model_float16_groups, opt.model_fp32_groups):
            values = {decay[id(p)] for p in (*low, *full)}
            if len(values) > 1:
                raise ValueError(f"a Megatron optimizer group mixes weight decays {sorted(values)}: its standard "
                                 "overrides split parameters otherwise than the trainer (decay on >= 2-D tensors)")
            if values:
                group["weight_decay"] = values.pop()
            else:  # no parameter of this group in this rank's shard: Megatron's own value
                group["weight_decay"] = group["weight_decay"] * group.get("wd_mult", 1.0)
