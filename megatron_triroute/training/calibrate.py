"""Budget calibration of the deployed policy: one bisection per resource on the prices of
`routing.pricing` (see its module docstring for why), run once at the end of training, and by the
serving tools' `--calibrate` on a checkpoint written mid-run (evaluation/calibration.py).

The evaluation callback is given the prices to try and runs the noise-free policy priced by them
over calibration batches of *training* data (held-out data stays untouched for the report),
returning the realised (FLOPs, memory) fractions reduced over all ranks, so every rank takes the
same bisection path and ends with bit-identical prices. The bisection only reads the budget (its
targets and multipliers); the caller keeps the prices it returns (the checkpoint stores them in
`BudgetController.prices`).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from ..config import RouterConfig
from ..routing.budget import RESOURCES, BudgetController

log = logging.getLogger(__name__)

BRACKET_STEPS = 12
"""Doublings of the initial price step while looking for a bracket (2^12 logit units per unit of
cost fraction is far beyond any policy's logit margins: at the top every priced decision takes its
cheapest option, so the realised fraction there is the lowest the policy can reach)."""


REPAIR_STEPS = 8
"""Attempts to restore feasibility after the lock-step bisection (see calibrate_prices)."""


TOLERANCE = 1e-6
"""Realised fractions closer than this count as equal: an allowance for float64 summation order
(ranks, batches), far below the precision the fractions are reported with."""


def movable_resources(router: RouterConfig) -> tuple[bool, bool]:
    """(FLOPs, memory): whether some routed decision prices the resource. FLOPs move with the
    attention modes, or with the experts when the null expert lets a token skip the FFN; memory
    moves with routed bit-widths only."""
    return (router.attn_routing or (router.expert_routing and router.null_expert), router.bit_routing)


def calibrate_prices(budget: BudgetController, realised_at: Callable[[list[float]], list[float]],
                     movable: tuple[bool, bool] = (True, True), bisection_steps: int = 14) -> dict:
    """The prices (mu_flops, mu_mem) at which the noise-free policy's realised fractions meet
    `budget`'s targets; `realised_at(prices)` measures the policy priced by `prices`.

    Resource r is *active* when its multiplier is positive at the end of training (the tied knob
    makes both active together). An active resource is met with equality (its price may be
    negative: a policy under budget spends up to it); an inactive one only ever gets a
    non-negative price, i.e. it is lowered to its target if above it and left alone otherwise.
    Both prices bisect in lock-step (the FLOPs price moves attention and expert decisions, the
    memory price moves bit-widths). The final prices are the feasible side of each bracket, so the
    realised fraction ends at or just below the target. `movable[r]` is False where no routed
    decision prices resource r (e.g. uniform KV bits): its price stays 0.

    An infeasible target (still exceeded at the largest bracket price, where every priced decision
    already takes its cheapest option, e.g. FLOPs without a null expert, whose FFN never drops
    below dense cost) is warned about and its price capped at the *smallest* price that reaches
    the lowest fraction seen there: every larger price gives the same cost on the calibration data
    and only moves the policy further from the trained logits, and the bracket's top is an artefact
    of BRACKET_STEPS. A resource no decision prices is infeasible when its fixed cost exceeds the
    target. Returns the record for the log and summary.json: prices (the calibrated ones: the
    caller keeps them), realised_before/after,
    targets, active, feasible (per resource: realised_after within TOLERANCE of the target or under).
    """
    cfg = budget.config
    targets = budget.targets.tolist()
    lam = budget.multipliers()
    active = [bool(lam[0] > 0)] * 2 if cfg.tied else [bool(x > 0) for x in lam]
    start = realised_at([0.0, 0.0])

    # Bracket [lo, hi] per resource with realised(lo) >= goal >= realised(hi); cost falls as price rises.
    goal = list(targets)
    lo, hi = [0.0, 0.0], [0.0, 0.0]
    raised: dict[int, list[tuple[float, float]]] = {}  # r -> (price, realised) of each upward probe
    todo = []
    for r in range(2):
        if not movable[r]:
            continue
        if start[r] > targets[r]:
            todo.append(r)
            hi[r] = 1.0
            raised[r] = [(0.0, start[r])]
        elif start[r] < targets[r] and active[r]:
            todo.append(r)
            lo[r] = -1.0
    for _ in range(BRACKET_STEPS):
        probe = [hi[r] if (r in todo and hi[r] > 0) else lo[r] if r in todo else 0.0 for r in range(2)]
        seen = realised_at(probe)
        open_ = False
        for r in todo:
            if hi[r] > 0 and seen[r] > targets[r]:
                raised[r].append((hi[r], seen[r]))
                lo[r], hi[r], open_ = hi[r], hi[r] * 2, True
            elif lo[r] < 0 and seen[r] < targets[r]:
                hi[r], lo[r], open_ = lo[r], lo[r] * 2, True
        if not open_:
            break
    unreachable = [r for r in todo if hi[r] > 0 and seen[r] > targets[r]]
    for r in unreachable:
        # Still over the target at the largest price (the bracket never closed): aim at the lowest
        # fraction reached instead, between the first probe that reached it and the one before.
        lowest = min(x for _, x in raised[r])
        first = next(i for i, (_, x) in enumerate(raised[r]) if x <= lowest + TOLERANCE)
        goal[r] = lowest + TOLERANCE
        lo[r], hi[r] = (raised[r][first - 1][0], raised[r][first][0]) if first else (0.0, 0.0)
    for _ in range(bisection_steps if todo else 0):
        mid = [(lo[r] + hi[r]) / 2 if r in todo else 0.0 for r in range(2)]
        seen = realised_at(mid)
        for r in todo:
            if seen[r] > goal[r]:
                lo[r] = mid[r]
            else:
                hi[r] = mid[r]
    final = [hi[r] if r in todo else 0.0 for r in range(2)]
    end = realised_at(final)
    # The two prices interact weakly (a layer's decisions feed the next layer's controller), so the
    # FLOPs side found with one memory price can sit a hair above its target with the other: raise
    # the offending price by growing steps until both are met.
    for k in range(REPAIR_STEPS):
        over = [r for r in todo if end[r] > goal[r]]
        if not over:
            break
        for r in over:
            final[r] += max(hi[r] - lo[r], 1e-3) * 2**k
        end = realised_at(final)
    feasible = [end[r] <= targets[r] + TOLERANCE for r in range(2)]
    for r in range(2):
        if feasible[r]:
            continue
        name, fix = RESOURCES[r], f"raise triroute.budget.{RESOURCES[r]}_target to at least {end[r]:.4f}"
        if r in unreachable:
            log.warning("budget calibration: the %s target %.4g cannot be met: with every priced decision at its "
                        "cheapest option the realised fraction is still %.4f; the %s price is capped at %.4g, the "
                        "smallest that reaches it. Fix: %s, or give the routing a cheaper option (e.g. "
                        "router.null_expert=true for FLOPs)", name, targets[r], end[r], name, final[r], fix)
        elif r in todo:
            log.warning("budget calibration: the %s target %.4g was not met: the bisection and %d repair steps "
                        "ended at %.4f with the %s price %.4g", name, targets[r], REPAIR_STEPS, end[r], name, final[r])
        else:
            log.warning("budget calibration: the %s target %.4g cannot be met: no routed decision prices %s and "
                        "the realised fraction is %.4f. Fix: %s, or route it (e.g. router.bit_routing=true for "
                        "memory)", name, targets[r], name, end[r], fix)
    record = {"prices": final, "realised_before": start, "realised_after": end, "targets": targets,
              "active": active, "feasible": feasible}
    log.info("budget calibration: prices %s | realised (flops, mem) %s -> %s | targets %s | feasible %s",
             [round(p, 4) for p in final], [round(x, 4) for x in start], [round(x, 4) for x in end], targets,
             feasible)
    return record


class RealisedTail:
    """Per-step realised (FLOPs, memory) fractions of the training policy over the last 20 % of
    the run's steps: how far the primal-dual loop still swings at the end (reported in summary)."""

    def __init__(self, total_steps: int, share: float = 0.2):
        self.first = total_steps - max(1, int(round(share * total_steps)))
        self.values: list[list[float]] = []

    def add(self, step: int, realised: list[float]) -> None:
        if step >= self.first:
            self.values.append(list(realised))

    def summary(self) -> dict:
        if not self.values:
            return {"steps": 0}
        x = torch.tensor(self.values, dtype=torch.float64)
        return {"steps": len(self.values), "mean": x.mean(0).tolist(), "std": x.std(0, correction=0).tolist(),
                "min": x.amin(0).tolist(), "max": x.amax(0).tolist()}
