"""Which rank writes (and reads back) each parameter's optimizer state in a checkpoint.

Every parameter has exactly one owner among the ranks that hold a replica of it: dense parameters
are owned within the data-parallel group, expert parameters within the expert-data-parallel group
(the ranks that hold the same experts). Ownership is a greedy size balance over the parameters in
model order, so it is the same on every rank and depends only on the group size. A checkpoint
stores each parameter's whole AdamW moments once, by its owner (checkpoint/sharded.py), whatever
the shards of the distributed optimizer that stepped it.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn


def _assign(params: list[tuple[str, nn.Parameter]], size: int) -> list[int]:
    """Owner index (0..size-1) of each parameter: largest first onto the least loaded rank."""
    load = [0] * size
    owner = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: (-params[i][1].numel(), i)):
        r = min(range(size), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += params[i][1].numel()
    return owner


def owned_parameters(named_groups: list[dict], groups) -> list[tuple[str, nn.Parameter]]:
    """The (name, parameter) pairs this rank owns, over the optimizer's `named_groups` (dicts whose
    "params" are (name, parameter) pairs)."""
    owned = []
    for spec in named_groups:
        for is_expert in (False, True):
            subset = [(n, p) for n, p in spec["params"] if (getattr(p, "allreduce", True) is False) == is_expert]
            if not subset:
                continue
            ranks = list(groups.edp_ranks) if is_expert else list(groups.dp_ranks)
            me = ranks.index(dist.get_rank()) if len(ranks) > 1 else 0
            owner = _assign(subset, len(ranks))
            owned += [subset[i] for i in range(len(subset)) if owner[i] == me]
    return owned
