"""TriRoute's expert layer on DeepSpeed-MoE: routes come from the controller, DeepSpeed moves tokens.

The controller's expert head has already chosen, per token, ``k`` experts and their renormalised
weights; index ``-1`` is the null expert (skip the FFN, output exactly zero). This layer does no
routing of its own. It hands those routes to DeepSpeed 0.19.8's ``MOELayer`` through
:class:`PrecomputedGate`, a gate that speaks ``MOELayer``'s sparse-route contract, so DeepSpeed's
own dispatch (slot encode, all-to-all over the expert-parallel group, the experts, all-to-all
back, weighted decode) does the rest. The experts are :class:`~megatron_triroute.experts.stacked.StackedExperts`
(three stacked parameters per layer, marked as DeepSpeed's ``Experts`` marks its own:
``allreduce=False`` and ``group_name``, which DeepSpeed's engine and
:func:`megatron_triroute.parallel.grad_reduce.reduce_gradients` use to reduce them over the
expert-data-parallel group).

Capacity. ``capacity_factor=None`` (default) never drops: the capacity is the largest number of
routes any expert receives on any rank of the expert-parallel group (an all-reduce MAX), so a
token's output does not depend on the other tokens in the batch. With a factor ``c`` the capacity
is ``max(1, ceil(c * N * k / E))`` (max over the group when ranks hold different ``N``) and routes
beyond it are dropped deterministically, slot-major: every token's route in column 0 of
``expert_index`` is placed before any route in column 1, and within a column lower token indices
come first; the routes that do not fit are the dropped ones. A dropped route contributes zero and
the token's other weights are not renormalised (the routing core owns the weights).

Packed expert compute. DeepSpeed's own ``Experts`` runs every expert on all ``capacity`` slots of its
buffer, the unfilled ones included, so a no-drop step pays the fullest expert's load on every
expert: ``E * capacity`` rows for the ``N * k`` routes (1.6-2.3x at the 160m shape with the
routes of a fresh controller). Without tensor parallel the gate all-gathers every rank's route
counts over the expert-parallel group (in place of the capacity's all-reduce; nothing with one
rank) and reads them to the host in the single read that gives the capacity, so each rank knows
how many slots of every (source rank, local expert) buffer are filled; ``StackedExperts`` runs
each expert on those rows only (one call over every source rank's) and pads its output with zeros
to ``capacity``. That is exact: a buffer is filled from the front (``_slot_in_expert``), an unfilled
slot's input is zero, a SwiGLU expert (no biases) maps zero to zero and adds nothing to its
weights' gradients, and the decode gives such slots no token. With tensor parallel (MOELayer slices
the slots per tensor-parallel rank) the whole buffer is computed, as DeepSpeed does.

One rank, every expert. Where one rank holds every expert (expert parallel 1, no tensor parallel)
and nothing is dropped, there is nothing to dispatch: with ``compute="grouped"`` or ``"auto"`` (the
default) the layer skips ``MOELayer`` and runs the routes through
:func:`megatron_triroute.experts.grouped.grouped_swiglu` (one sort, three grouped matmuls, no host
read) over the same stacked expert parameters, on a GPU and on a CPU alike.

Tensor parallel. With tensor parallel > 1, ``MOELayer`` assumes every tensor-parallel rank holds
the same tokens: each rank dispatches a 1/tp slice of the capacity slots and the results are
all-gathered afterwards (capacity is padded to a multiple of tp). Under sequence parallel the
tensor-parallel ranks hold different tokens and that slicing would silently lose tokens, so this
layer refuses ``sequence_parallel=True`` with tp > 1; gather the sequence before the layer.
"""

from __future__ import annotations

import importlib
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_triroute.config import EXPERT_COMPUTE, EXPERT_COMPUTE_FIX
from megatron_triroute.experts.grouped import compute_dtype, grouped_layout_ok, grouped_swiglu
from megatron_triroute.experts.routes import order_by_expert
from megatron_triroute.experts.stacked import InitMethod, StackedExperts, default_init_method
from megatron_triroute.routing.gating import NULL_EXPERT

if TYPE_CHECKING:
    from megatron_triroute.parallel.groups import ParallelGroups


class PrecomputedGate(nn.Module):
    """A DeepSpeed 0.19.8 ``MOELayer`` gate that returns routes set by :meth:`set_routes`.

    ``MOELayer.forward`` calls ``gate(tokens, used_token, True, use_tutel)`` and unpacks the
    sparse-route 7-tuple of ``top2gating(..., sparse_routes=True)``::

        l_aux       0-dim float   auxiliary loss: zero (the routing core owns balancing losses)
        capacity    0-dim int64   slots per expert
        num_experts int           E
        indices     (k, N) int32  expert of each route; -1 for null-expert and dropped routes
        locations   (k, N) int32  slot of each route inside its expert's buffer
        gates       (k, N) fp32   route weight (differentiable; zero for null and dropped routes)
        exp_counts  (E,)   int64  routes requested per expert before capacity drops (detached)
    """

    def __init__(self, num_experts: int, k: int, capacity_factor: float | None = None) -> None:
        super().__init__()
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor={capacity_factor} must be positive, or None for no drops")
        self.num_experts = num_experts
        self.k = k
        self.capacity_factor = capacity_factor
        self.ep_group = None
        self._routes: tuple[torch.Tensor, torch.Tensor] | None = None
        self.filled: list[list[int]] | None = None
        """Filled slots of each (source rank, local expert) buffer this rank's experts receive in
        the last forward (None with tensor parallel): PackedExperts reads them once."""

    def _set_ep_group(self, ep_group: Any) -> None:
        self.ep_group = ep_group

    def set_routes(self, expert_index: torch.Tensor, expert_weight: torch.Tensor) -> None:
        """Routes for the next forward only: ``expert_index`` (N, k) long, ``expert_weight`` (N, k)."""
        if expert_index.shape != expert_weight.shape or expert_index.dim() != 2:
            raise ValueError(
                f"expert_index {tuple(expert_index.shape)} and expert_weight {tuple(expert_weight.shape)} "
                "must both be (N, k)"
            )
        if expert_index.shape[1] != self.k:
            raise ValueError(f"routes have k={expert_index.shape[1]} columns; this gate was built with k={self.k}")
        out_of_range = (expert_index < NULL_EXPERT) | (expert_index >= self.num_experts)
        if bool(out_of_range.any()):  # one host read
            raise ValueError(f"expert_index values must be in [-1, {self.num_experts}); -1 is the null expert")
        self._routes = (expert_index, expert_weight)

    def forward(
        self,
        input: torch.Tensor,
        used_token: torch.Tensor | None = None,
        sparse_routes: bool = True,
        use_tutel: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if not sparse_routes or use_tutel:
            raise NotImplementedError("PrecomputedGate only produces sparse routes without Tutel")
        if self._routes is None:
            raise RuntimeError("PrecomputedGate has no routes: call set_routes(expert_index, expert_weight) first")
        expert_index, expert_weight = self._routes
        self._routes = None  # routes belong to exactly one forward
        num_tokens = input.shape[0]
        if expert_index.shape[0] != num_tokens:
            raise ValueError(f"routes cover {expert_index.shape[0]} tokens but the layer received {num_tokens}")

        index = expert_index.t().to(device=input.device, dtype=torch.long)  # (k, N), slot-major
        if used_token is not None:
            index = torch.where(used_token.to(index.device).bool().unsqueeze(0), index, NULL_EXPERT)
        routed = index >= 0  # (k, N); the null expert is never dispatched
        locations, counts = _slot_in_expert(index, self.num_experts)  # (k, N), (E + 1,)
        exp_counts = counts[: self.num_experts]  # (E,): the null expert's count is last

        capacity = self._capacity(exp_counts, num_tokens)
        kept = routed & (locations < capacity)
        indices = torch.where(kept, index, NULL_EXPERT)
        gates = torch.where(kept, expert_weight.t().to(input.device, torch.float32), 0.0)
        l_aux = input.new_zeros((), dtype=torch.float32)
        return (
            l_aux,
            torch.tensor(capacity, dtype=torch.long),
            self.num_experts,
            indices.to(torch.int32),
            (locations * kept).to(torch.int32),
            gates,
            exp_counts.detach(),
        )

    def _capacity(self, exp_counts: torch.Tensor, num_tokens: int) -> int:
        """Slots per expert, equal on every rank of the expert-parallel group (the all-to-all needs
        it). Without tensor parallel, also the filled slots of each (source rank, local expert)
        buffer this rank's experts will receive (`filled`), from the same host read."""
        self.filled = None
        tp = _deepspeed_tensor_parallel_size()
        ep = dist.get_world_size(self.ep_group) if self.ep_group is not None else 1
        if tp == 1:
            # every rank's route counts and token count: one all-gather over the group (in place of
            # the capacity's all-reduce) and the one host read
            local = torch.cat([exp_counts, exp_counts.new_tensor([num_tokens])])
            if ep > 1:
                gathered = [torch.empty_like(local) for _ in range(ep)]
                dist.all_gather(gathered, local, group=self.ep_group)
                local = torch.stack(gathered)
            table = local.view(ep, -1).tolist()  # per rank: E route counts, then its token count
            if self.capacity_factor is None:
                capacity = max(1, max(max(row[:-1], default=0) for row in table))
            else:
                capacity = max(1, max(math.ceil(self.capacity_factor * row[-1] * self.k / self.num_experts)
                                      for row in table))
            e_local = self.num_experts // ep
            first = (dist.get_rank(self.ep_group) if ep > 1 else 0) * e_local
            self.filled = [[min(row[first + i], capacity) for i in range(e_local)] for row in table]
            return capacity
        if self.capacity_factor is None:  # no drops: the fullest expert's count, read on the host once below
            local = exp_counts.max() if exp_counts.numel() else exp_counts.new_zeros(())
            capacity = local.clamp_min(1).view(1)
        else:
            local = math.ceil(self.capacity_factor * num_tokens * self.k / self.num_experts)
            # On the tokens' device: NCCL reduces only device tensors.
            capacity = torch.tensor([max(1, local)], dtype=torch.long, device=exp_counts.device)
        if ep > 1:
            dist.all_reduce(capacity, op=dist.ReduceOp.MAX, group=self.ep_group)
        # MOELayer hands each tensor-parallel rank (of DeepSpeed's mpu) an equal slice of the slots.
        return math.ceil(int(capacity) / tp) * tp


def _deepspeed_tensor_parallel_size() -> int:
    """The tensor-parallel size MOELayer slices by: DeepSpeed's ``groups.mpu`` (1 when unset)."""
    ds_groups = importlib.import_module("deepspeed.utils.groups")
    bwc = importlib.import_module("deepspeed.utils.bwc")
    return bwc.bwc_tensor_model_parallel_world_size(ds_groups.mpu)


def _slot_in_expert(index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Position of every route among the routes to the same expert, in flattened (k, N) order, and
    the routes per expert (E + 1,: the null expert last).

    A stable sort by expert keeps the slot-major order inside each expert; null routes sort last
    and get meaningless positions (the caller masks them).
    """
    key, order, counts = order_by_expert(index, num_experts)
    first = torch.cumsum(counts, 0) - counts  # first sorted position of each expert
    sorted_position = torch.arange(key.numel(), device=key.device) - first[key[order]]
    position = torch.empty_like(sorted_position)
    position[order] = sorted_position
    return position.view_as(index), counts


class TriRouteExperts(nn.Module):
    """SwiGLU experts behind DeepSpeed's ``MOELayer``, driven by precomputed TriRoute routes.

    ``groups`` gives the expert-parallel layout (``None``: one process, all experts local). Each
    rank builds ``num_experts / groups.ep`` experts, global indices ``ep_rank * E_local + i``.
    Every expert is initialised from its own seed drawn from the CPU generator, so the same global
    seed gives the same expert weights whatever the expert-parallel size.
    """

    def __init__(
        self,
        d_model: int,
        d_expert: int,
        num_experts: int,
        groups: ParallelGroups | None = None,
        capacity_factor: float | None = None,
        init_method: InitMethod | None = None,
        output_init_method: InitMethod | None = None,
        top_k: int = 2,
        sequence_parallel: bool = False,
        compute: str = "auto",
    ) -> None:
        super().__init__()
        sharded_moe = importlib.import_module("deepspeed.moe.sharded_moe")

        ep, ep_rank, tp = (groups.ep, groups.ep_rank, groups.tp) if groups is not None else (1, 0, 1)
        if num_experts % ep:
            raise ValueError(f"num_experts={num_experts} is not divisible by expert_parallel={ep}")
        if sequence_parallel and tp > 1:
            raise ValueError(
                f"sequence_parallel with tensor_parallel={tp} is not supported by the DeepSpeed expert layer: "
                "DeepSpeed's MOELayer assumes every tensor-parallel rank holds the same tokens and keeps only "
                "a 1/tp slice of them, which would drop tokens; gather the sequence before this layer or set "
                "sequence_parallel=False"
            )
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep
        self.ep_rank = ep_rank
        self.top_k = top_k
        self.ep_group_name = groups.ep_group_name if groups is not None else "ep_size_1"

        _template_expert_draws(d_model, d_expert)
        experts = StackedExperts(d_model, d_expert, self.num_local_experts, self.ep_group_name)
        _init_per_expert(experts, ep_rank * self.num_local_experts, num_experts, init_method, output_init_method)
        self.gate = PrecomputedGate(num_experts, top_k, capacity_factor)
        experts.bind_gate(self.gate)
        self.moe = sharded_moe.MOELayer(self.gate, experts, self.ep_group_name, ep, self.num_local_experts)
        if compute not in EXPERT_COMPUTE:
            raise ValueError(f"expert compute {compute!r}: {EXPERT_COMPUTE_FIX}")
        self.compute = compute
        self.grouped = compute != "deepspeed" and ep == 1 and tp == 1 and capacity_factor is None
        """One rank holds every expert, nothing is sliced and nothing dropped: there is nothing to
        dispatch, and `experts.grouped` can compute the routes in three grouped matmuls with no host
        read (`compute="grouped"` or "auto"). Otherwise DeepSpeed's MOELayer (capacity, all-to-all,
        per-expert calls)."""
        if groups is not None:
            ds_groups = importlib.import_module("deepspeed.utils.groups")
            self.moe._set_ep_group(ds_groups._get_expert_parallel_group(self.ep_group_name))

    @property
    def experts(self) -> StackedExperts:
        """This rank's experts: stacked weights, local index order (global index ``ep_rank * E_local + i``)."""
        return self.moe.experts

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """Megatron dist-checkpointing view: each weight (w1 gate, w3 up, w2 down) is one global
        tensor `[..., num_experts, out, in]`, this rank's experts at their global ids
        `ep_rank * E_local + i`, so any expert-parallel size can load it. Experts are replicated over
        the expert-data-parallel ranks; the first of them writes."""
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        edp_rank = parallel_state.get_expert_data_parallel_rank() if parallel_state.model_parallel_is_initialized() else 0
        axis = len(sharded_offsets)
        ep = self.num_experts // self.num_local_experts
        out = {}
        for name, tensor in self.experts.state_dict(prefix="", keep_vars=True).items():
            key = f"{prefix}moe.experts.{name}"
            out[key] = ShardedTensor.from_rank_offsets(key, tensor, *sharded_offsets, (axis, self.ep_rank, ep),
                                                       replica_id=(0, 0, edp_rank), prepend_axis_num=axis)
        return out

    def forward(
        self, hidden: torch.Tensor, expert_index: torch.Tensor, expert_weight: torch.Tensor
    ) -> torch.Tensor:  # (N, d), (N, k), (N, k) -> (N, d)
        if self.uses_grouped(hidden):
            return grouped_swiglu(hidden, expert_index, expert_weight, *self.experts.weights())
        self.gate.set_routes(expert_index, expert_weight)
        return self.moe(hidden, None)  # MOELayer reads (tokens, used_token)

    def uses_grouped(self, hidden: torch.Tensor) -> bool:
        """Whether a forward on `hidden` takes the grouped matmuls (see `grouped`); rows whose width
        is not a multiple of 16 bytes in the compute dtype take DeepSpeed's dispatch."""
        return (self.grouped
                and grouped_layout_ok(self.experts.w1.weight.shape[1:], compute_dtype(hidden)))


def _template_expert_draws(d_model: int, d_expert: int) -> None:
    """Advance the default generator as building the one template expert that DeepSpeed's
    ``Experts`` container deep-copied did (each ``nn.Linear``'s own init of w1, w3, w2, then the
    default normal init of the three), so that a seed builds the same model, every later module
    included, as it did with that container."""
    shapes = ((d_expert, d_model), (d_expert, d_model), (d_model, d_expert))
    for shape in shapes:
        nn.init.kaiming_uniform_(torch.empty(shape), a=math.sqrt(5))
    for shape in shapes:
        default_init_method(torch.empty(shape))


def _init_per_expert(
    experts: StackedExperts,
    first_global_index: int,
    num_experts: int,
    init_method: InitMethod | None,
    output_init_method: InitMethod | None,
) -> None:
    """Initialise local expert ``i`` from seed ``base + first_global_index + i``.

    ``base`` is drawn once from the CPU generator, for all ``num_experts`` experts on every rank, so
    the generator advances the same way whatever the expert-parallel size.
    """
    base = int(torch.randint(0, 2**31 - num_experts, ()))
    for i in range(experts.num_local_experts):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(base + first_global_index + i)
            experts.reset_expert(i, init_method, output_init_method)
