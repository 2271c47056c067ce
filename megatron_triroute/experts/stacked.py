"""A rank's SwiGLU experts as three stacked parameters, the module DeepSpeed's ``MOELayer`` calls.

    w1.weight, w3.weight (E_local, d_expert, d_model), w2.weight (E_local, d_model, d_expert)

Expert ``i``'s projections are ``w1.weight[i]`` etc., each an ``nn.Linear`` weight, so expert ``i``
computes ``w2_i(silu(w1_i x) * w3_i x)`` (:func:`swiglu`). One parameter per projection rather than
one per expert and projection: a layer has 3 expert tensors for the optimizer, the gradient buffers
and the checkpoint instead of 3 E, the grouped matmuls take the weights as they are (no stacking
copy per forward), and a gradient accumulates into each once per backward.

Each parameter carries ``allreduce=False`` and ``group_name`` as DeepSpeed's ``Experts`` marks its
own, which DeepSpeed's engine, Megatron's DDP adapter and
:func:`megatron_triroute.parallel.grad_reduce.reduce_gradients` read to reduce them over the
expert-data-parallel group. Each projection is a small module whose call returns its weight, so
hooks that modules' forward runs (Megatron DDP's wait for an overlapped parameter all-gather) run
wherever the weights are used.

Checkpoints written with one module per expert (``deepspeed_experts.<i>.w1.weight``, the layout of
DeepSpeed's ``Experts``) load through :func:`megatron_triroute.checkpoint.sharded.stack_per_expert_names`.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint.sharded import stack_per_expert_names

InitMethod = Callable[[torch.Tensor], object]  # Megatron convention: initialise a tensor in place

default_init_method: InitMethod = functools.partial(nn.init.normal_, mean=0.0, std=0.02)

def swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert: w2(silu(w1 x) * w3 x), each w an nn.Linear weight (out, in); (..., d) -> (..., d)."""
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


class ExpertWeight(nn.Module):
    """One projection of every local expert: `weight` (E_local, out, in). Calling it returns the
    weight (running the module's forward hooks)."""

    def __init__(self, num_local_experts: int, out_features: int, in_features: int, group_name: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_local_experts, out_features, in_features))
        self.weight.allreduce = False
        self.weight.group_name = group_name

    def forward(self) -> torch.Tensor:
        return self.weight


class StackedExperts(nn.Module):
    """A rank's experts for ``MOELayer``: (ep, E_local, capacity, d) -> the same, expert ``i`` on its
    buffer ``[:, i]``. Where its gate knows how many slots of each (source rank, expert) buffer are
    filled (`PrecomputedGate.filled`), each expert runs on those rows only and the unfilled slots are
    zero (exact: a buffer fills from the front, an unfilled slot's input is zero, and a SwiGLU without
    biases maps zero to zero); otherwise each expert runs on its whole buffer, as DeepSpeed's
    ``Experts`` does."""

    def __init__(self, d_model: int, d_expert: int, num_local_experts: int, group_name: str) -> None:
        super().__init__()
        self.num_local_experts = num_local_experts
        self.w1 = ExpertWeight(num_local_experts, d_expert, d_model, group_name)
        self.w3 = ExpertWeight(num_local_experts, d_expert, d_model, group_name)
        self.w2 = ExpertWeight(num_local_experts, d_model, d_expert, group_name)
        self._register_load_state_dict_pre_hook(_stack_legacy_names)

    def bind_gate(self, gate) -> None:
        self.__dict__["_gate"] = gate  # a reference, not a submodule: no state-dict entry

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w3, w2), each stacked over the local experts, through the projections' calls."""
        return self.w1(), self.w3(), self.w2()

    def expert(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Local expert i's (w1, w3, w2): views of the stacked parameters."""
        return self.w1.weight[i], self.w3.weight[i], self.w2.weight[i]

    def reset_expert(self, i: int, init_method: InitMethod | None = None,
                     output_init_method: InitMethod | None = None) -> None:
        """Initialise expert i: w1 and w3 with `init_method` (default: normal, std 0.02), then w2 with
        `output_init_method` (default: the same), in that order."""
        init_method = init_method or default_init_method
        with torch.no_grad():
            init_method(self.w1.weight[i])
            init_method(self.w3.weight[i])
            (output_init_method or init_method)(self.w2.weight[i])

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:  # (ep, E_local, capacity, d)
        gate = self.__dict__.get("_gate")
        filled = gate.filled if gate is not None else None
        if gate is not None:
            gate.filled = None  # one forward's
        # unbind: its backward stacks the experts' gradients once (an indexed select's would write
        # each into zeros of the whole parameter)
        experts = list(zip(*(w.unbind(0) for w in self.weights())))
        if filled is None or len(filled) != inputs.shape[0] or len(filled[0]) != self.num_local_experts:
            return torch.stack([swiglu(x, *w) for x, w in zip(inputs.unbind(1), experts)], dim=1)
        capacity = inputs.shape[2]
        if inputs.shape[0] == 1:  # one source rank: each expert's filled rows, padded, stacked once
            outputs = [F.pad(swiglu(x[: filled[0][i]], *experts[i]), (0, 0, 0, capacity - filled[0][i]))
                       for i, x in enumerate(inputs.squeeze(0).unbind(0))]
            return torch.stack(outputs).unsqueeze(0)
        # Buffers by unbind, not by indexing: an indexed select's backward writes its gradient into
        # zeros of the whole (ep, E_local, capacity, d) buffer, once per expert (and source rank), and
        # sums them; unbind's backward stacks the pieces once.
        buffers = [expert_in.unbind(0) for expert_in in inputs.unbind(1)]  # [expert][rank] (capacity, d)
        outputs = []
        for i in range(self.num_local_experts):
            rows = [per_rank[i] for per_rank in filled]  # filled slots from each source rank
            x = torch.cat([b[:r] for b, r in zip(buffers[i], rows)])  # the expert's rows from every rank, one call
            parts = swiglu(x, *experts[i]).split(rows)
            outputs.append(torch.stack([F.pad(part, (0, 0, 0, capacity - r)) for part, r in zip(parts, rows)]))
        return torch.stack(outputs, dim=1)


def _stack_legacy_names(state_dict, prefix, *unused) -> None:
    """Load-state-dict pre-hook: per-expert entries under `prefix` become the stacked ones."""
    mine = {k: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(prefix + "deepspeed_experts.")]}
    state_dict.update(stack_per_expert_names(mine))
