"""One optimizer step of a TriRoute model on any (TP, PP, EP, DP) layout.

    routing.begin -> Megatron's forward-backward schedule over the micro-batches
    -> gradient reduction (dense over DP, experts over EDP) -> global norm (non-finite: skip,
    routing.discard) -> clip -> optimizer -> routing.end (the model's routing bookkeeping,
    model/routing_step.py)

An evaluation pass runs the same schedule forward-only inside `routing.evaluation(prices)`.

Megatron's tensor/pipeline sharding sizes each rank's parameters; DeepSpeed-MoE places experts.
Gradients are reduced by the run's data-parallel engine (`grad_sync`, parallel/dp_engine.py):
Megatron-Core's DDP reduce-scattering into its distributed optimizer
(parallel/megatron_distopt.py), which is then both `grad_sync` and `optimizer`; with a plain torch
optimizer (no `grad_sync`) the flat `reduce_gradients` after backward, which leaves the whole
reduced gradient in every `p.grad`. The engine asks
`grad_sync` for the global norm and the clip, so it never needs to know where gradients live.
Megatron's schedule runs forward/backward for PP = 1 and PP > 1 alike, so there is one code path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func

from ..parallel.devices import collective_device, module_device


@dataclass
class MicroBatch:
    tokens: torch.Tensor
    """(B, T) int64 input ids."""
    labels: torch.Tensor
    """(B, T) int64 next-token targets."""
    loss_mask: torch.Tensor
    """(B, T) float: 1 where the target is scored."""
    sample_index: torch.Tensor
    """(B,) int64 global sample index (the routing noise key)."""

    def to(self, device: torch.device) -> "MicroBatch":
        """This micro-batch on `device` (itself when already there)."""
        if self.tokens.device == device:
            return self
        return MicroBatch(*(t.to(device, non_blocking=True) for t in
                            (self.tokens, self.labels, self.loss_mask, self.sample_index)))


@dataclass
class StepReport:
    step: int
    loss: float
    """Mean LM loss over the global batch's scored tokens (nan if skipped)."""
    skipped: bool
    grad_norm: float
    tau: float
    realised: list[float] = field(default_factory=list)
    """Noise-free (FLOPs, memory) fractions of this global batch."""
    lambdas: list[float] = field(default_factory=list)
    statistics: torch.Tensor | None = None
    """Per-layer router statistics summed over the global batch (see RouterStatistics)."""


class TrainEngine:
    """Owns the step logic; data, checkpoints and logging live in the trainer."""

    def __init__(self, model, groups, optimizer: torch.optim.Optimizer, total_steps: int,
                 clip_grad: float = 1.0, scheduler=None, bf16: bool = False, grad_sync=None):
        from ..parallel.megatron_ddp import ReplicatedGradSync

        self.model, self.groups, self.optimizer = model, groups, optimizer
        # begin / finish / discard of the data-parallel gradient reduction (parallel/megatron_ddp.py)
        self.grad_sync = grad_sync if grad_sync is not None else ReplicatedGradSync(model, groups)
        self.bf16 = bf16
        self.scheduler = scheduler
        self.total_steps = total_steps
        self.clip_grad = clip_grad
        self.forward_backward = get_forward_backward_func()

    # ------------------------------------------------------------------------------------
    def train_step(self, micro_batches: list[MicroBatch], step: int) -> StepReport:
        model, routing = self.model, self.model.routing_step
        tau = routing.begin(step, self.total_steps, len(micro_batches))
        if not model.training:  # evaluation leaves train mode on; a walk of every module otherwise
            model.train()
        self.grad_sync.begin()
        with self._autocast():
            losses = self.forward_backward(
                forward_step_func=_forward_step, data_iterator=iter(micro_batches), model=model,
                num_microbatches=len(micro_batches), seq_length=model.wire_seq_len,
                micro_batch_size=micro_batches[0].tokens.shape[0], forward_only=False,
            )
        loss_sum, token_count = self._global_loss(losses)
        loss = loss_sum / max(token_count, 1.0)
        self.grad_sync.finish()  # waits for the buckets reduced during backward, if any
        grad_norm = self.grad_sync.grad_norm()  # whole gradients, or the distributed optimizer's shards
        # Loss and norm are reduced over every rank, so all ranks agree to skip (a NaN or inf in any
        # gradient makes the global norm non-finite).
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.grad_sync.discard()
            routing.discard()
            return StepReport(step, float("nan"), True, float("nan"), tau)
        self.grad_sync.clip(grad_norm, self.clip_grad)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        realised, lambdas, stats = routing.end(self.groups)
        return StepReport(step, loss, False, grad_norm, tau, realised.tolist(), lambdas, stats)

    @torch.no_grad()
    def evaluate(self, batches: list[MicroBatch], prices: list[float] | None = None) -> tuple[float, list[float]]:
        """(mean loss per scored token, realised [FLOPs, memory] fractions) over `batches` with the
        noise-free decisions (eval mode) priced by `prices` (mu_flops, mu_mem; None: the plain
        argmax), i.e. the policy that runs at inference with those prices.

        Data-parallel ranks split the batches (each the same number, since expert-parallel
        all-to-alls span data-parallel ranks). The budget and the training statistics are untouched.
        """
        model, g, routing = self.model, self.groups, self.model.routing_step
        usable = len(batches) - len(batches) % g.dp
        mine = batches[g.dp_rank : usable : g.dp]
        local = torch.zeros(2, dtype=torch.float64, device=collective_device())
        with routing.evaluation(prices):
            if mine:
                with self._autocast():
                    losses = self.forward_backward(
                        forward_step_func=_forward_step, data_iterator=iter(mine), model=model,
                        num_microbatches=len(mine), seq_length=model.wire_seq_len,
                        micro_batch_size=mine[0].tokens.shape[0], forward_only=True,
                    )
                for item in losses:
                    local += item["lm"].double().to(local.device)
            self._reduce_dp_pp(local)
            realised = model.router_statistics.realised(routing.statistics(g))
        return local[0].item() / max(local[1].item(), 1.0), realised

    # ------------------------------------------------------------------------------------
    def _autocast(self):
        """bf16 compute over fp32 parameters (the router opts out and stays fp32)."""
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return torch.autocast(device, dtype=torch.bfloat16, enabled=self.bf16)

    def _reduce_dp(self, t: torch.Tensor) -> None:
        if self.groups.dp > 1:
            dist.all_reduce(t, group=self.groups.dp_group)

    def _reduce_dp_pp(self, t: torch.Tensor) -> None:
        """Sum over the whole global batch and all layers: DP replicas, then pipeline stages."""
        self._reduce_dp(t)
        if self.groups.pp > 1:
            dist.all_reduce(t, group=self.groups.pp_group)

    def _global_loss(self, losses: list[dict]) -> tuple[float, float]:
        """Sum of scored-token losses and their count over the global batch (every rank)."""
        local = torch.zeros(2, dtype=torch.float64, device=collective_device())
        for item in losses:  # only the last pipeline stage returns losses
            local += item["lm"].double().to(local.device)
        self._reduce_dp_pp(local)
        return local[0].item(), local[1].item()


def _forward_step(data_iterator: Iterator[MicroBatch], model):
    """Megatron schedule callback: run one micro-batch (moved to the model's device), return its
    loss function."""
    mb = next(data_iterator).to(module_device(model))
    output = model(mb.tokens, mb.sample_index, labels=mb.labels)
    return output, lambda out: _loss(out, mb)


def _loss(per_token: torch.Tensor, mb: MicroBatch):
    mask = mb.loss_mask.float()
    loss_sum = (per_token.float() * mask).sum()
    count = mask.sum()
    report = {"lm": torch.stack([loss_sum.detach().double(), count.double()])}
    return loss_sum, count.clamp_min(1).to(torch.int), report
