"""Running router statistics that change once per optimizer step, from the global batch.

Whitening (Eq. whiten) and gradient balancing (Eq. gradbal) keep running statistics. Three
rules make them safe under data, tensor and pipeline parallelism and activation recompute:

1. The forward pass reads the statistics as they were *before* this batch, so a token's
   decision never depends on other tokens of its batch.
2. Micro-batches only *accumulate* (sums in float64); nothing changes until `commit`.
3. `commit_running_statistics` concatenates every module's accumulator, reduces them with ONE
   caller-supplied all-reduce (sum over the data-parallel group, plus any ranks that hold
   different tokens), and updates every statistic identically on every rank.

Modules of one kind (`batch_key`) commit together (`commit_all`): one batched update over all of
them instead of a chain of small ops per module (a model has one whitening and one gradient
balance per routed axis and layer).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn


def in_backward_pass() -> bool:
    """True while autograd runs a backward graph (e.g. activation recompute's re-forward)."""
    return torch._C._current_graph_task_id() != -1


def ema_from_first(steps: torch.Tensor, old: torch.Tensor, new: torch.Tensor, momentum: float) -> torch.Tensor:
    """An exponential moving average that starts at its first value: `new` while `steps` is 0, else
    old * momentum + new * (1 - momentum). A select, not a branch on the step count: no host read,
    so nothing waits for the device (the budget's EMA, the REINFORCE reward baseline)."""
    return torch.where(steps == 0, new, old * momentum + new * (1 - momentum))


class RunningStatistic(nn.Module):
    """A module with a float64 accumulator committed once per optimizer step."""

    def pending(self) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def commit(self, reduced: torch.Tensor) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def batch_key(self) -> object:
        """Modules with equal keys commit together through `type(self).commit_all`; the default
        (the module itself) commits each module alone."""
        return self

    @classmethod
    def commit_all(cls, stats: list["RunningStatistic"], reduced: list[torch.Tensor]) -> None:
        """Commit `stats` (equal `batch_key`s) from their reduced accumulators."""
        for stat, r in zip(stats, reduced):
            stat.commit(r)

    def should_accumulate(self) -> bool:
        """Accumulate in training forwards only, never in a recompute inside backward."""
        return self.training and not in_backward_pass()


def running_statistics(modules: Iterable[nn.Module]) -> list[RunningStatistic]:
    """Every RunningStatistic under `modules`, in a deterministic (registration) order."""
    found: list[RunningStatistic] = []
    for module in modules:
        found.extend(m for m in module.modules() if isinstance(m, RunningStatistic))
    return found


def commit_running_statistics(
    modules: Iterable[nn.Module], all_reduce: Callable[[torch.Tensor], None] | None = None
) -> None:
    """Reduce all pending accumulators in one collective and commit them.

    `all_reduce` must sum in place across the ranks whose tokens form the global batch
    (e.g. `lambda t: dist.all_reduce(t, group=dp_group)`); None for a single process.
    """
    stats = running_statistics(modules)
    if not stats:
        return
    buffers = [s.pending() for s in stats]
    flat = torch.cat([b if b.dim() == 1 else b.reshape(-1) for b in buffers])
    if all_reduce is not None:
        all_reduce(flat)
    reduced = [r if r.shape == b.shape else r.view_as(b) for r, b in zip(flat.split([b.numel() for b in buffers]), buffers)]
    batches: dict[object, list[int]] = {}
    for i, stat in enumerate(stats):
        batches.setdefault(stat.batch_key(), []).append(i)
    for members in batches.values():
        type(stats[members[0]]).commit_all([stats[i] for i in members], [reduced[i] for i in members])


def discard_running_statistics(modules: Iterable[nn.Module]) -> None:
    """Drop every pending accumulator (a skipped step must not move any statistic)."""
    pending = [stat.pending() for stat in running_statistics(modules)]
    if pending:
        torch._foreach_zero_(pending)
