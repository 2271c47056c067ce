"""Every process group of a run, built in one place: Megatron-Core's parallel state and DeepSpeed's
expert groups, checked against each other.

Layout (Megatron's default order ``tp-cp-ep-dp-pp``, expert tensor parallel fixed at 1)::

    world = tp * dp * pp                 dense:   tensor x data x pipeline
    world = ep * edp * pp                experts: expert x expert-data x pipeline

Tensor-parallel ranks are adjacent, then data-parallel, with pipeline stages outermost. Expert
groups are ``ep`` consecutive ranks of one pipeline stage (they may cut across tensor-parallel
groups), and the expert-data-parallel group joins the ranks holding the same expert shard. The
dense data-parallel group spans the expert dimension: ``dp = edp * ep / tp``.

Example, 4 ranks, tp=2, ep=2: tp {0,1} {2,3}; dp {0,2} {1,3}; ep {0,1} {2,3}; edp {0,2} {1,3}.

Megatron and DeepSpeed keep their groups as their own module globals; this module adds none. It
returns a frozen :class:`ParallelGroups` that callers pass explicitly to whatever needs groups.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from megatron_triroute.parallel.cpu_compat import shim_active

ProcessGroup = Any  # torch.distributed.ProcessGroup (its stub type differs across torch versions)


class ParallelLayoutError(ValueError):
    """A parallel layout that cannot be built; the message names the value to change."""


class GroupMismatchError(RuntimeError):
    """DeepSpeed's expert groups differ from Megatron-Core's (a library changed its rank order)."""


@dataclass(frozen=True)
class ParallelGroups:
    """The process groups of this rank, with sizes and this rank's index in each.

    Sizes: ``tp`` tensor, ``pp`` pipeline, ``dp`` dense data parallel (spans the expert
    dimension), ``ep`` expert parallel, ``edp`` expert data parallel. ``ep_group_name`` is
    DeepSpeed's name for this expert layout (``ep_size_<ep>``); expert parameters carry it as
    ``group_name``. ``*_ranks`` are the global ranks of this rank's group, in group order.
    """

    world_size: int
    rank: int
    tp: int
    pp: int
    dp: int
    ep: int
    edp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    ep_rank: int
    edp_rank: int
    tp_group: ProcessGroup
    pp_group: ProcessGroup
    dp_group: ProcessGroup
    ep_group: ProcessGroup
    edp_group: ProcessGroup
    tp_ranks: tuple[int, ...]
    dp_ranks: tuple[int, ...]
    ep_ranks: tuple[int, ...]
    edp_ranks: tuple[int, ...]
    ep_group_name: str


def validate_layout(
    world_size: int,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    num_experts: int | None = None,
    n_kv_heads: int | None = None,
) -> None:
    """Raise :class:`ParallelLayoutError` naming the fix when the layout cannot be built.

    Checks: ``tp * pp`` divides ``world_size``; ``tp`` divides ``n_kv_heads`` (each tensor-parallel
    rank owns whole KV heads); ``ep`` divides the ranks of one pipeline stage (``world_size / pp``,
    Megatron carves expert groups out of ``tp * dp``); ``ep`` divides ``num_experts``.
    """
    for name, value in (("world_size", world_size), ("tensor_parallel", tp), ("pipeline_parallel", pp),
                        ("expert_parallel", ep)):
        if not isinstance(value, int) or value < 1:
            raise ParallelLayoutError(f"{name}={value!r} must be a positive integer")
    if world_size % (tp * pp):
        valid_tp = [t for t in _divisors(world_size) if world_size % (t * pp) == 0]
        raise ParallelLayoutError(
            f"world_size={world_size} is not divisible by tensor_parallel*pipeline_parallel={tp * pp} "
            f"({tp}x{pp}); with pipeline_parallel={pp} use tensor_parallel in {_set(valid_tp)}, "
            f"or run on a multiple of {tp * pp} processes"
        )
    if n_kv_heads is not None and n_kv_heads % tp:
        valid_tp = [t for t in _divisors(n_kv_heads) if world_size % (t * pp) == 0]
        raise ParallelLayoutError(
            f"tensor_parallel={tp} does not divide n_kv_heads={n_kv_heads}; use tensor_parallel in {_set(valid_tp)}"
        )
    stage_ranks = world_size // pp
    if stage_ranks % ep:
        raise ParallelLayoutError(
            f"expert_parallel={ep} does not divide the {stage_ranks} ranks of a pipeline stage "
            f"(world_size/pipeline_parallel = {world_size}/{pp}); use expert_parallel in "
            f"{_set(_valid_ep(stage_ranks, num_experts))}"
        )
    if num_experts is not None and num_experts % ep:
        raise ParallelLayoutError(
            f"num_experts={num_experts} is not divisible by expert_parallel={ep}; use expert_parallel in "
            f"{_set(_valid_ep(stage_ranks, num_experts))}"
        )


def initialize_parallel(tensor_parallel: int = 1, pipeline_parallel: int = 1, expert_parallel: int = 1) -> ParallelGroups:
    """Build Megatron-Core's parallel state and DeepSpeed's expert groups; return them as one object.

    Call after ``torch.distributed.init_process_group`` and, on a CPU-only machine, inside
    :func:`megatron_triroute.parallel.cpu_shim` (DeepSpeed's comm setup needs it). Raises :class:`ParallelLayoutError` for an
    impossible layout and :class:`GroupMismatchError` when DeepSpeed's expert or expert-data rank
    lists differ from Megatron's. Undo with :func:`destroy_parallel`.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised; call torch.distributed.init_process_group('gloo' or 'nccl') "
            "before initialize_parallel()"
        )
    world_size = dist.get_world_size()
    tp, pp, ep = tensor_parallel, pipeline_parallel, expert_parallel
    validate_layout(world_size, tp, pp, ep)
    if not shim_active():
        raise RuntimeError("on a machine without CUDA, call initialize_parallel() inside "
                           "`with megatron_triroute.parallel.cpu_shim():` (Megatron-Core and DeepSpeed need its "
                           "CPU workarounds for as long as they run)")

    parallel_state = importlib.import_module("megatron.core.parallel_state")
    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError("Megatron parallel state is already initialised; call destroy_parallel() first")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        # Experts are whole on each rank: gloo cannot all-gather the uneven shapes expert TP needs,
        # and DeepSpeed's MOELayer would otherwise gather tokens between its two all-to-alls.
        expert_tensor_parallel_size=1,
    )
    ep_group_name = _build_deepspeed_groups(tp, pp, ep)

    groups = ParallelGroups(
        world_size=world_size,
        rank=dist.get_rank(),
        tp=tp,
        pp=pp,
        dp=parallel_state.get_data_parallel_world_size(),
        ep=ep,
        edp=parallel_state.get_expert_data_parallel_world_size(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
        dp_rank=parallel_state.get_data_parallel_rank(),
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        edp_rank=parallel_state.get_expert_data_parallel_rank(),
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        pp_group=parallel_state.get_pipeline_model_parallel_group(),
        dp_group=parallel_state.get_data_parallel_group(),
        ep_group=parallel_state.get_expert_model_parallel_group(),
        edp_group=parallel_state.get_expert_data_parallel_group(),
        tp_ranks=_ranks(parallel_state.get_tensor_model_parallel_group()),
        dp_ranks=_ranks(parallel_state.get_data_parallel_group()),
        ep_ranks=_ranks(parallel_state.get_expert_model_parallel_group()),
        edp_ranks=_ranks(parallel_state.get_expert_data_parallel_group()),
        ep_group_name=ep_group_name,
    )
    check_deepspeed_matches_megatron(groups)
    if groups.tp * groups.dp * groups.pp != world_size or groups.ep * groups.edp * groups.pp != world_size:
        raise GroupMismatchError(
            f"group sizes do not tile the world: tp={groups.tp} dp={groups.dp} pp={groups.pp} "
            f"ep={groups.ep} edp={groups.edp} world_size={world_size}"
        )
    return groups


def check_deepspeed_matches_megatron(groups: ParallelGroups) -> None:
    """Raise :class:`GroupMismatchError` unless DeepSpeed's EP/EDP/DP rank lists equal Megatron's."""
    ds_groups = importlib.import_module("deepspeed.utils.groups")
    name = groups.ep_group_name
    pairs = (
        ("expert-parallel", tuple(ds_groups._get_expert_parallel_group_ranks(name)), groups.ep_ranks),
        ("expert-data-parallel", tuple(ds_groups._get_expert_data_parallel_group_ranks(name)), groups.edp_ranks),
        ("data-parallel", _ranks(ds_groups._get_data_parallel_group()), groups.dp_ranks),
    )
    for what, deepspeed_ranks, megatron_ranks in pairs:
        if deepspeed_ranks != megatron_ranks:
            raise GroupMismatchError(
                f"rank {groups.rank}: DeepSpeed's {what} group {list(deepspeed_ranks)} differs from "
                f"Megatron-Core's {list(megatron_ranks)} (tp={groups.tp}, pp={groups.pp}, ep={groups.ep}); "
                "one library changed its rank order: update _build_deepspeed_groups in "
                "megatron_triroute/parallel/groups.py"
            )


def destroy_parallel() -> None:
    """Forget Megatron's and DeepSpeed's groups (torch.distributed itself stays initialised)."""
    importlib.import_module("megatron.core.parallel_state").destroy_model_parallel()
    ds_groups = importlib.import_module("deepspeed.utils.groups")
    ds_groups._release_process_group_references(None)  # clears expert groups, the mpu, cached world


def _build_deepspeed_groups(tp: int, pp: int, ep: int) -> str:
    """Create DeepSpeed's expert and expert-data groups in Megatron's rank order; return their name."""
    import deepspeed.comm as ds_comm
    from deepspeed.utils import groups as ds_groups

    if not ds_comm.is_initialized():
        # Wraps the existing torch.distributed world; it does not initialise a second one.
        ds_comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False, verbose=False)
    # MOELayer reads the tensor-parallel size and group from `groups.mpu` (token drop/gather).
    ds_groups.mpu = MegatronMpu()
    # DeepSpeed's "sp" ordering takes consecutive ranks of a pipeline stage as one expert group,
    # which is Megatron's order with expert_tensor_parallel_size=1; its "tp" ordering (and
    # _create_expert_data_and_model_parallel) would instead group ranks of equal tensor rank.
    ds_groups._create_expert_and_data_parallel(ep, mp_size=tp, pp_size=pp, mp_mode="sp")
    return f"ep_size_{ep}"


class MegatronMpu:
    """Megatron-Core's parallel state under the ``mpu`` interface DeepSpeed queries.

    DeepSpeed's "model parallel" means tensor slicing, so the ``get_model_parallel_*`` aliases
    answer for the tensor-parallel group (as Megatron-DeepSpeed's mpu did).
    """

    def __init__(self) -> None:
        self._state = importlib.import_module("megatron.core.parallel_state")

    def get_tensor_model_parallel_world_size(self) -> int:
        return self._state.get_tensor_model_parallel_world_size()

    def get_tensor_model_parallel_rank(self) -> int:
        return self._state.get_tensor_model_parallel_rank()

    def get_tensor_model_parallel_group(self) -> ProcessGroup:
        return self._state.get_tensor_model_parallel_group()

    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_group = get_tensor_model_parallel_group

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self._state.get_pipeline_model_parallel_world_size()

    def get_pipeline_model_parallel_rank(self) -> int:
        return self._state.get_pipeline_model_parallel_rank()

    def get_pipeline_model_parallel_group(self) -> ProcessGroup:
        return self._state.get_pipeline_model_parallel_group()

    def get_data_parallel_world_size(self) -> int:
        return self._state.get_data_parallel_world_size()

    def get_data_parallel_rank(self) -> int:
        return self._state.get_data_parallel_rank()

    def get_data_parallel_group(self) -> ProcessGroup:
        return self._state.get_data_parallel_group()

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(_ranks(self._state.get_data_parallel_group()))


def _ranks(group: ProcessGroup) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _valid_ep(stage_ranks: int, num_experts: int | None) -> list[int]:
    return [e for e in _divisors(stage_ranks) if num_experts is None or num_experts % e == 0]


def _set(values: list[int]) -> str:
    return "{" + ", ".join(str(v) for v in values) + "}"
