"""ZeRO-1: the optimizer state sharded over data-parallel replicas, by parameter.

Every parameter has exactly one owner among the ranks that hold a replica of it: dense parameters
are owned within the data-parallel group, expert parameters within the expert-data-parallel group
(the ranks that hold the same experts). After the gradients are reduced (every replica holds the
same gradient), each rank runs AdamW on the parameters it owns only, then every owner broadcasts
its updated parameters to its group. The update is the replicated optimizer's, bit for bit; the
AdamW moments take 1/dp (experts: 1/edp) of the memory.

Ownership is a greedy size balance over the parameters in model order, so it is the same on every
rank and depends only on the group size. Checkpoints store each rank's owned states by parameter
name, so a run resumed on another data-parallel size gathers the states of the parameters it now
owns from whichever old ranks held them (see run_state).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint.sharded import MOMENTS


def _assign(params: list[tuple[str, nn.Parameter]], size: int) -> list[int]:
    """Owner index (0..size-1) of each parameter: largest first onto the least loaded rank."""
    load = [0] * size
    owner = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: (-params[i][1].numel(), i)):
        r = min(range(size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += params[i][1].numel()
    return owner


def _ownership(named: list[tuple[str, nn.Parameter]], groups):
    """(group, its global ranks, parameters, owner index of each) for the dense parameters of
    `named` (owned within the data-parallel group) and its expert parameters (within the
    expert-data-parallel group); a kind with no parameter is left out."""
    for is_expert in (False, True):
        subset = [(n, p) for n, p in named if (getattr(p, "allreduce", True) is False) == is_expert]
        if subset:
            group, ranks = (groups.edp_group, list(groups.edp_ranks)) if is_expert else \
                (groups.dp_group, list(groups.dp_ranks))
            yield group, ranks, subset, _assign(subset, len(ranks))


def owned_parameters(named_groups: list[dict], groups) -> list[tuple[str, nn.Parameter]]:
    """The (name, parameter) pairs this rank owns: whose optimizer state it writes to a checkpoint
    and reads back (every parameter has one owner among its replicas, whatever the engine)."""
    owned = []
    for spec in named_groups:
        for _, ranks, subset, owner in _ownership(spec["params"], groups):
            me = ranks.index(dist.get_rank()) if len(ranks) > 1 else 0
            owned += [subset[i] for i in range(len(subset)) if owner[i] == me]
    return owned


class ShardedAdamW:
    """AdamW whose state is sharded over data-parallel replicas (ZeRO stage 1).

    `param_groups` are torch-style groups of (name, parameter) pairs with their options. It exposes
    what the trainer uses of a torch optimizer: step, zero_grad, param_groups (for the scheduler),
    state_dict/load_state_dict (name-keyed, this rank's owned parameters only).
    """

    def __init__(self, named_groups: list[dict], groups, **adamw_kwargs):
        self.groups = groups
        self._owned: list[tuple[str, nn.Parameter]] = []
        self._broadcasts: list[tuple[object, list[int], list[list[nn.Parameter]]]] = []
        local_groups = []
        for spec in named_groups:
            options = {k: v for k, v in spec.items() if k != "params"}
            mine = []
            for group, ranks, subset, owner in _ownership(spec["params"], groups):
                me = ranks.index(dist.get_rank()) if len(ranks) > 1 else 0
                mine += [subset[i] for i in range(len(subset)) if owner[i] == me]
                per_owner = [[subset[i][1] for i in range(len(subset)) if owner[i] == r] for r in range(len(ranks))]
                self._broadcasts.append((group, ranks, per_owner))
            self._owned += mine
            local_groups.append({"params": [p for _, p in mine], **options})
        self.optimizer = torch.optim.AdamW(local_groups, **adamw_kwargs)
        self.param_groups = self.optimizer.param_groups
        self._names = {id(p): n for n, p in self._owned}

    @torch.no_grad()
    def step(self) -> None:
        self.optimizer.step()
        self._broadcast_updates()

    def _broadcast_updates(self) -> None:
        """Every owner sends its updated parameters to the other replicas of its group."""
        for group, ranks, per_owner in self._broadcasts:
            if len(ranks) == 1:
                continue
            for r, params in zip(ranks, per_owner):
                if not params:
                    continue
                flat = torch.cat([p.data.reshape(-1) for p in params])
                dist.broadcast(flat, src=r, group=group)
                offset = 0
                for p in params:
                    p.data.copy_(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()

    def sync_params(self) -> None:
        """Nothing pending: `step` broadcasts the updated parameters before it returns."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    # -- checkpoints: name-keyed, owned parameters only -------------------------------------
    def state_dict(self) -> dict:
        state = {self._names[id(p)]: s for p, s in self.optimizer.state.items()}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return {"state": state, "param_groups": groups}

    def owned_names(self) -> list[str]:
        return [n for n, _ in self._owned]

    def owned_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return list(self._owned)

    def adam_step(self) -> int | None:
        """The AdamW step count (the same for every parameter), None before the first step."""
        for state in self.optimizer.state.values():
            if "step" in state:
                return int(state["step"])
        return None

    # -- the checkpoint protocol of `checkpoint/sharded.py` (whole moments of owned parameters) --
    def has_moments(self) -> bool:
        """Whether this rank's owned parameters have AdamW moments (from the first step on)."""
        return any(self.optimizer.state.get(p) for _, p in self._owned)

    def master_parameters(self) -> dict[int, torch.Tensor]:
        """The parameters are fp32, their own masters: no other value to store."""
        return {}

    def load_master_parameters(self, values: dict[int, torch.Tensor]) -> None:
        if values:
            raise ValueError("ZeRO-1 AdamW steps fp32 parameters and keeps no master copy; bf16 parameters need "
                             "parallel.dp_engine=megatron_distopt")

    def owned_moments(self) -> dict[str, dict[str, torch.Tensor]]:
        """{owned parameter name: {"exp_avg": ..., "exp_avg_sq": ...}}, each of its parameter's shape."""
        return {n: {m: self.optimizer.state[p][m] for m in MOMENTS} for n, p in self._owned}

    def load_owned_moments(self, moments: dict[str, dict[str, torch.Tensor]], adam_step: int) -> None:
        """Set every owned parameter's moments (as `owned_moments` gives them) and the AdamW step."""
        for name, param in self._owned:
            self.optimizer.state[param] = {"step": torch.tensor(float(adam_step), dtype=torch.float32),
                                           **{m: moments[name][m] for m in MOMENTS}}

    def load_state_dict(self, state_dicts: Iterable[dict]) -> None:
        """Restore from one or more saved (name-keyed) states: each owned parameter's state is
        taken from whichever of them holds it. Group options come from the first."""
        state_dicts = list(state_dicts)
        merged: dict[str, dict] = {}
        for sd in state_dicts:
            merged.update(sd["state"])
        missing = [n for n in self.owned_names() if n not in merged]
        if missing and merged:
            raise KeyError(f"optimizer state missing for parameters {missing[:5]}: the checkpoint does not "
                           "match this model")
        for (name, p) in self._owned:
            if name in merged:
                self.optimizer.state[p] = {k: _state_value(p, k, v) for k, v in merged[name].items()}
        for group, saved in zip(self.optimizer.param_groups, state_dicts[0]["param_groups"]):
            group.update({k: v for k, v in saved.items() if k in group})


def _state_value(p: torch.Tensor, key: str, value):
    """A loaded optimizer state value placed as torch's own `load_state_dict` places it: Adam's
    `step` counter stays on the CPU, every other tensor moves to its parameter's device (states
    are loaded to the CPU; a GPU run needs them beside the parameters)."""
    if not torch.is_tensor(value):
        return value
    if key == "step":
        return value.clone()
    return value.to(p.device, copy=True)
