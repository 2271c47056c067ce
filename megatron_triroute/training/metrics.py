"""Turning step reports into TensorBoard scalars, console progress and collapse warnings.

Scalars (tag names are stable; tests read them back):
  train/lm_loss, train/lr, train/temperature, train/tokens_per_s, train/grad_norm,
  budget/lambda_{flops,mem}, budget/realised_{flops,mem}, budget/target_{flops,mem},
  router/{attn,experts,bits}/fraction_{option}        (global, all layers)
  router/{attn,experts,bits}/entropy/layer_{l}        (normalised marginal entropy per layer)
  valid/ppl, valid/{bucket}_ppl
"""

from __future__ import annotations

import json
import logging
import math
import time

import torch

from ..config import TriRouteConfig
from ..routing.modes import ATTN_MODES
from ..model.routing_step import RouterStatistics
from ..progress import clock, eta

log = logging.getLogger("megatron_triroute.train")


def axis_options(config: TriRouteConfig) -> dict[str, list[str]]:
    r = config.router
    experts = (["null"] if r.null_expert else []) + [f"e{i}" for i in range(r.num_experts)]
    bits = [f"{b}bit" for b in (r.bits if r.bit_routing else (r.uniform_bits,))]
    out = {"attn": list(ATTN_MODES), "bits": bits}
    if r.expert_routing:
        out["experts"] = experts
    return out


def router_scalars(stats: torch.Tensor, config: TriRouteConfig) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Global option fractions and per-layer normalised marginal entropies from the step's
    per-layer sums (RouterStatistics layout)."""
    layout = RouterStatistics(config)
    sl = layout.slices()
    tokens = stats[:, sl["tokens"]].clamp_min(1)  # (L, 1)
    scalars: dict[str, float] = {}
    entropies: dict[str, list[float]] = {}
    for axis, names in axis_options(config).items():
        frac = stats[:, sl[f"{axis}/fraction"]].sum(0) / tokens.sum()
        for name, value in zip(names, frac.tolist()):
            scalars[f"router/{axis}/fraction_{name}"] = value
        probs = stats[:, sl[f"{axis}/prob"]] / tokens  # (L, O) marginal soft probabilities
        if len(names) > 1 and probs.sum() > 0:
            p = probs.clamp_min(1e-12)
            ent = (-(p * p.log()).sum(-1) / math.log(len(names)))
            # A layer that makes no decision on this axis (a layer-group follower's attention) has no
            # entropy: NaN, neither logged nor warned about as a collapse.
            ent = torch.where(probs.sum(-1) > 0, ent, torch.nan).tolist()
            entropies[axis] = ent
            for layer, value in enumerate(ent):
                if not math.isnan(value):
                    scalars[f"router/{axis}/entropy/layer_{layer}"] = value
    return scalars, entropies


def training_flops_per_token(config: TriRouteConfig, realised_flops: float) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward, 2 FLOPs per MAC) of the routed
    model: the budgeted part (attention reads + FFN, Appendix A's dense cost scaled by the realised
    fraction) plus what the budget does not count (Q/K/V/O projections and the output layer)."""
    m = config.model
    T = m.seq_len
    mean_keys = (T + 1) / 2  # mean of t + 1 over positions 0..T-1
    budgeted = 2 * m.d_model * mean_keys + 3 * m.d_model * m.d_ff
    projections = (m.n_heads + 2 * m.n_kv_heads) * m.d_head * m.d_model + m.n_heads * m.d_head * m.d_model
    forward_macs = m.n_layers * (realised_flops * budgeted + projections) + m.vocab_size * m.d_model
    return 3 * 2 * forward_macs


def collapse_warnings(entropies: dict[str, list[float]], threshold: float) -> list[str]:
    return [f"router collapse: axis '{axis}' in layer {layer} has normalised entropy {value:.3f} < {threshold}"
            for axis, values in entropies.items() for layer, value in enumerate(values) if value < threshold]


class StepProgress:
    """Console progress line: step, loss, rate, ETA."""

    def __init__(self, total_steps: int, start_step: int, tokens_per_step: int):
        self.total, self.start = total_steps, start_step
        self.tokens_per_step = tokens_per_step
        self.t0 = time.time()
        self.last = self.t0

    def line(self, step: int, loss: float, realised: list[float], lambdas: list[float], lr: float) -> tuple[str, float]:
        now = time.time()
        done = step + 1 - self.start
        rate = done / max(now - self.t0, 1e-9)
        left = eta(done, self.total - self.start, now - self.t0)
        tokens_per_s = rate * self.tokens_per_step
        text = (f"step {step + 1}/{self.total} | loss {loss:.4f} | lr {lr:.2e} | "
                f"cost flops {realised[0]:.3f} mem {realised[1]:.3f} | lambda {' '.join(f'{x:.3f}' for x in lambdas)} | "
                f"{tokens_per_s:,.0f} tok/s | {rate:.2f} it/s | ETA {clock(left)}")
        return text, tokens_per_s


class TensorBoard:
    """Writes scalars on one rank only (others get a no-op)."""

    def __init__(self, log_dir: str | None):
        self.writer = None
        if log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=log_dir)

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self.writer is None:
            return
        for tag, value in values.items():
            if value is not None and math.isfinite(value):
                self.writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class StepLogger:
    """What one training step reports: a line in OUTPUT/steps.jsonl (every step, rank 0: what the
    resume and preemption tests compare), and every `log_interval` steps (and the last) the progress
    line with throughput and MFU, the TensorBoard scalars and the collapse warnings."""

    def __init__(self, run, out_dir, rank0: bool, world_size: int, start_step: int, tb: "TensorBoard"):
        self.run, self.out_dir, self.rank0, self.world_size, self.tb = run, out_dir, rank0, world_size, tb
        t = run.train
        self.progress = StepProgress(t.steps, start_step, t.global_batch_size * run.triroute.model.seq_len)

    def step(self, step: int, report, lr: float) -> None:
        run, t = self.run, self.run.train
        if self.rank0:
            with open(self.out_dir / "steps.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": report.loss, "skipped": report.skipped,
                                    "grad_norm": report.grad_norm, "lr": lr, "realised": report.realised,
                                    "lambdas": report.lambdas}) + "\n")
        if not (not report.skipped and (step + 1) % t.log_interval == 0 or step + 1 == t.steps):
            return
        line, tokens_per_s = self.progress.line(step, report.loss, report.realised, report.lambdas, lr)
        scalars, entropies = router_scalars(report.statistics, run.triroute)
        scalars.update({
            "train/lm_loss": report.loss, "train/lr": lr, "train/temperature": report.tau,
            "train/tokens_per_s": tokens_per_s, "train/grad_norm": report.grad_norm,
            "budget/realised_flops": report.realised[0], "budget/realised_mem": report.realised[1],
            "budget/target_flops": run.triroute.budget.flops_target,
            "budget/target_mem": run.triroute.budget.mem_target,
        })
        for i, lam in enumerate(report.lambdas):
            scalars[f"budget/lambda_{['flops', 'mem'][i] if len(report.lambdas) == 2 else 'tied'}"] = lam
        tflops = tokens_per_s * training_flops_per_token(run.triroute, report.realised[0]) / 1e12
        scalars["train/tflops"] = tflops
        line += f" | {tflops / self.world_size:.3f} TFLOP/s/rank"
        if t.peak_tflops > 0:
            scalars["train/mfu"] = tflops / (t.peak_tflops * self.world_size)
            line += f" | MFU {scalars['train/mfu']:.1%}"
        self.tb.scalars(scalars, step + 1)
        if self.rank0:
            log.info(line)
            for warning in collapse_warnings(entropies, t.collapse_entropy):
                log.warning("step %d: %s", step + 1, warning)
