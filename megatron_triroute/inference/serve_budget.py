"""A budget per request at serve time: (FLOPs, KV-memory) targets met by per-request prices.

The deployed policy is the price-weighted argmax of routing/pricing.py, and a request's realised
cost fraction is non-increasing in its price, so the same weights serve any budget the routing
reaches by other prices. Two parts:

1. The price curve (`PriceCurve`): the realised (FLOPs, memory) fractions of the noise-free
   policy on the calibration batches at a grid of prices (`PRICE_GRID`, both prices in lock-step:
   the FLOPs price moves attention and expert decisions, the memory price the bit-widths, and the
   two interact only weakly), made non-increasing (a running minimum) and inverted by linear
   interpolation: a request's starting prices. A target below the curve's lowest fraction is
   infeasible (ValueError naming the reachable range); a target above its highest is a budget the
   most expensive policy already keeps, served at the lowest price of the grid.
2. Per-request control (`RequestBudget`): the curve is an average over calibration text, and one
   request's fractions differ from it (its positions, its text). After every step the request's
   running realised fraction over its generated tokens (the tokens it fed back, each decoded with
   the prices of its step) corrects the fraction the next step aims at (`RequestBudget.update`:
   the request's recent bias against the curve removed, its error so far paid back), clipped to
   the reachable range, and the curve turns the aim into the next step's price. State is the request's own, so a request's tokens and prices do not
   depend on the batch it is served in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import torch

from ..input_errors import InputError

PRICE_GRID = tuple(sorted({0.0} | {s * 2.0 ** (k / 2) for s in (-1.0, 1.0) for k in range(-12, 21)}))
"""Prices sampled by the curve: 0 and +-2^(k/2) for k in [-12, 20] (1/64 to 1024 logit units per
unit of cost fraction); the top is far beyond the policy's logit margins, so the curve reaches
the cheapest policy (calibrate.BRACKET_STEPS makes the same argument), the bottom the dearest."""

PAYBACK_GAIN = 4.0
"""How hard a request's aim pays back its running error (RequestBudget.update)."""

BIAS_WEIGHT = 0.3
"""Weight of the newest step in a request's bias against the curve (RequestBudget.update). With
these two, held-out prompts of a six-step and of a 2200-step tiny run, 64 new tokens, five
budgets across the reachable range, landed within 0.010 and 0.006 of their targets (a bias
averaged over all steps instead: 0.035 and 0.018; the curve's prices alone: up to 0.09)."""


class InfeasibleTargetError(InputError, ValueError):
    """A target the routing cannot reach (a ValueError for the API, exit status 2 for a command line)."""


@dataclass
class PriceCurve:
    """Realised fractions at ascending prices, one curve per resource (module doc, part 1)."""

    prices: list[float]
    flops: list[float]
    mem: list[float]

    def __post_init__(self):
        if not (len(self.prices) == len(self.flops) == len(self.mem) >= 2):
            raise ValueError("a price curve needs as many fractions per resource as prices, at least two")
        if any(b <= a for a, b in zip(self.prices, self.prices[1:])):
            raise ValueError("a price curve's prices must be strictly ascending")
        self.flops, self.mem = _non_increasing(self.flops), _non_increasing(self.mem)

    def to_dict(self) -> dict:
        return {"prices": list(self.prices), "flops": list(self.flops), "mem": list(self.mem)}

    @classmethod
    def from_dict(cls, d: dict) -> "PriceCurve":
        return cls([float(x) for x in d["prices"]], [float(x) for x in d["flops"]], [float(x) for x in d["mem"]])

    def reachable(self, r: int) -> tuple[float, float]:
        """(lowest, highest) realised fraction of resource r (0: FLOPs, 1: memory) on the curve."""
        f = self._fractions(r)
        return f[-1], f[0]

    def check(self, r: int, target: float) -> None:
        """InfeasibleTargetError (a ValueError) when `target` is below what the routing reaches (the
        cheapest policy) or not a positive fraction."""
        lo, hi = self.reachable(r)
        name = ("FLOPs", "KV-memory")[r]
        if not target > 0:
            raise InfeasibleTargetError(f"{name} target {target}: must be a fraction of the dense cost above 0")
        if target < lo - 1e-9:
            raise InfeasibleTargetError(f"{name} target {target:g} is infeasible: this model's routing reaches {name} fractions "
                             f"from {lo:.4f} (every priced decision at its cheapest option) to {hi:.4f}. Fix: ask for "
                             f"a target of at least {lo:.4f}.")

    def price_for(self, r: int, fraction: float) -> float:
        """The price at which resource r's curve passes `fraction` (clipped to the reachable range;
        a flat stretch at the fraction gives its lowest price)."""
        f, p = self._fractions(r), self.prices
        if fraction >= f[0]:
            return p[0]
        if fraction <= f[-1]:
            return p[next(i for i, x in enumerate(f) if x <= f[-1])]
        i = next(i for i in range(1, len(f)) if f[i] <= fraction)  # f[i-1] > fraction >= f[i]
        return p[i - 1] + (p[i] - p[i - 1]) * (f[i - 1] - fraction) / (f[i - 1] - f[i])

    def _fractions(self, r: int) -> list[float]:
        return self.flops if r == 0 else self.mem


def _non_increasing(values: list[float]) -> list[float]:
    out, low = [], float("inf")
    for x in values:
        low = min(low, float(x))
        out.append(low)
    return out


def sample_curve(realised_at: Callable[[list[float]], list[float]], grid: tuple[float, ...] = PRICE_GRID,
                 progress=None) -> PriceCurve:
    """The price curve from `realised_at(prices) -> [flops, mem]` (calibrate.calibrate_prices'
    callback: the noise-free policy on calibration batches) at `grid`, both prices in lock-step.
    `progress`: a `megatron_triroute.progress.Progress` over the grid's points (rate and ETA)."""
    seen = []
    for p in grid:
        seen.append(realised_at([p, p]))
        if progress is not None:
            progress.update(1, f"price {p:g}: realised {seen[-1][0]:.3f}, {seen[-1][1]:.3f}")
    return PriceCurve(list(grid), [s[0] for s in seen], [s[1] for s in seen])


@dataclass
class RequestBudget:
    """One request's targets and its prices (module doc, part 2). A target left None keeps the
    model's own price for that resource."""

    curve: PriceCurve
    targets: tuple[float | None, float | None]
    default: tuple[float, float]
    """The model's calibrated (mu_flops, mu_mem)."""
    control: bool = True
    """Correct the aim from the running realised fraction (False: the curve's price throughout)."""

    def __post_init__(self):
        for r, target in enumerate(self.targets):
            if target is not None:
                self.curve.check(r, target)
        self.aims = [t for t in self.targets]
        """The fractions the current prices aim at (None: the model's own price)."""
        self._seen = [0.0, 0.0, 0.0, 0.0]
        self._bias = [0.0, 0.0]
        self._steps = 0
        self.prices = self._prices()

    def _prices(self) -> list[float]:
        return [float(self.default[r]) if aim is None else self.curve.price_for(r, aim) for r, aim in enumerate(self.aims)]

    def update(self, totals: list[float]) -> None:
        """After a step that counts (a decode step), with the request's totals over its generated
        tokens so far ([budgeted MACs, dense MACs, KV bits, dense KV bits], CostAudit.requests):
        the next step's prices. Per resource, the step's realised fraction less the fraction it
        aimed at is the request's bias against the curve (an exponential average with weight
        BIAS_WEIGHT on the newest step), and the next aim is target - bias + PAYBACK_GAIN (target -
        running), running = total / dense: the bias removed, the error so far paid back."""
        if not self.control:
            return
        step = [a - b for a, b in zip(totals, self._seen)]
        self._seen = list(totals)
        self._steps += 1
        for r, target in enumerate(self.targets):
            if target is None or not step[2 * r + 1]:
                continue
            miss = step[2 * r] / step[2 * r + 1] - self.aims[r]
            self._bias[r] = miss if self._steps == 1 else (1 - BIAS_WEIGHT) * self._bias[r] + BIAS_WEIGHT * miss
            running = totals[2 * r] / totals[2 * r + 1]
            lo, hi = self.curve.reachable(r)
            self.aims[r] = min(max(target - self._bias[r] + PAYBACK_GAIN * (target - running), lo), hi)
        self.prices = self._prices()


def row_prices(budgets: list["RequestBudget | None"], own: tuple[float, float]):
    """(B, 2) float64 prices of a step's rows: each budget's own, `own` (the model's) for a row
    without one; None when no row has a budget (every row at the model's prices)."""
    if all(b is None for b in budgets):
        return None
    return torch.tensor([list(own) if b is None else b.prices for b in budgets], dtype=torch.float64)


def request_from_json(line: str, where: str, default: tuple) -> tuple[str, tuple]:
    """One line of a `.jsonl` prompts file, {"prompt": TEXT, "target_flops": F, "target_mem": M}: its
    prompt and (target_flops, target_mem), `default`'s where absent; an InputError naming the fix
    (exit status 2 in a command line) for anything else."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as error:
        raise InputError(f"{where}: not a JSON object ({error}). Fix: one object per line, "
                         '{"prompt": "...", "target_flops": 0.5, "target_mem": 0.4}') from None
    if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
        raise InputError(f'{where}: needs a "prompt" string. Fix: {{"prompt": "...", "target_flops": 0.5}}')
    unknown = set(obj) - {"prompt", "target_flops", "target_mem"}
    if unknown:
        raise InputError(f"{where}: unknown field(s) {sorted(unknown)}; the fields are prompt, target_flops, target_mem")
    targets = []
    for name, fallback in zip(("target_flops", "target_mem"), default):
        value = obj.get(name, fallback)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise InputError(f"{where}: {name}={value!r} must be a number (a fraction of the dense cost)")
        targets.append(None if value is None else float(value))
    return obj["prompt"], tuple(targets)
