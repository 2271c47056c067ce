"""Price calibration of a served checkpoint: `--calibrate` of evaluate, generate and export, and
`calibrate=true` of the lm-eval model.

A run calibrates its deployed prices once, at its normal end; a checkpoint written mid-run holds
prices 0 and serves the plain argmax policy (inference/prices.py). This runs the trainer's
bisection (`training.calibrate.calibrate_prices`) on the trainer's kind of batches (the training
batches trained last before the checkpoint's step, `training.data.calibration_batches`), with the
multipliers the checkpoint saved telling active constraints apart and the realised cost measured
by the inference engine's cost audit (`perplexity.evaluate_sets`), then leaves the prices on the
model.

The price curve of a served checkpoint (inference/serve_budget.py: realised fractions against
prices, what per-request targets are met by) is sampled the same way, on the same batches, with
the checkpoint's prices left as they are (`curve_loaded`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from ..inference.prices import is_priced, price_warning, prices_record
from .loading import EvaluationSetupError, Loaded
from .perplexity import evaluate_sets, run_datasets


def calibrate_model(model, dual: dict, batches: list, page_size: int = 16) -> dict:
    """Calibrate `model.prices` (an `InferenceModel`) on `batches` (MicroBatches) from the budget
    dual variables `dual` (`lambdas`, `ema`, `steps`, as a checkpoint saves them); returns
    calibrate_prices' record."""
    from ..routing.budget import BudgetController
    from ..training.calibrate import calibrate_prices, movable_resources

    config = model.config
    budget = BudgetController(config.budget)
    for name, value in dual.items():
        getattr(budget, name).copy_(value)

    calibration = calibrate_prices(budget, _realised_at(model, batches, page_size), movable_resources(config.router))
    model.prices.copy_(torch.tensor(calibration["prices"], dtype=torch.float64))
    return calibration


def _realised_at(model, batches: list, page_size: int) -> Callable[[list[float]], list[float]]:
    """calibrate_prices' callback: leaves `prices` on the model and measures the realised
    (FLOPs, memory) fractions of its noise-free policy on `batches` with the engine's cost audit."""
    def realised_at(prices: list[float]) -> list[float]:
        model.prices.copy_(torch.tensor(prices, dtype=torch.float64))
        result = evaluate_sets(model, {"calibration": batches}, page_size)[0]
        return [result.realised_flops, result.realised_mem]

    return realised_at


def curve_model(model, batches: list, page_size: int = 16, progress=None):
    """The price curve (serve_budget.PriceCurve) of `model` (an `InferenceModel`) on `batches`;
    the model's prices are restored after."""
    from ..inference.serve_budget import sample_curve

    kept = model.prices.clone()
    try:
        return sample_curve(_realised_at(model, batches, page_size), progress=progress)
    finally:
        model.prices.copy_(kept)


CURVE_CACHE = "price_curve.json"
"""A checkpoint's sampled price curve, kept in its step directory (outside the manifest: the
checkpoint's own files are untouched, and the directory's removal removes it) with the sha256 of
the manifest it was sampled for and the price grid, so that a curve of other weights or another
grid is never read back."""


def _curve_key(loaded: Loaded) -> dict:
    import hashlib

    from ..checkpoint.store import MANIFEST_FILE
    from ..inference.serve_budget import PRICE_GRID

    digest = hashlib.sha256((Path(loaded.step_path) / MANIFEST_FILE).read_bytes()).hexdigest()
    return {"manifest_sha256": digest, "grid": list(PRICE_GRID)}


def _cached_curve(loaded: Loaded):
    """The step directory's cached curve when it was sampled for these weights and this grid, else None."""
    from ..inference.serve_budget import PriceCurve

    try:
        cached = json.loads((Path(loaded.step_path) / CURVE_CACHE).read_text())
        if {k: cached.get(k) for k in ("manifest_sha256", "grid")} != _curve_key(loaded):
            return None
        return PriceCurve.from_dict(cached["curve"])
    except (OSError, ValueError, KeyError, TypeError):  # absent, unreadable or malformed: sample again
        return None


def _keep_curve(loaded: Loaded, curve) -> None:
    """Writes the cache (atomically); a read-only checkpoint keeps none."""
    from ..durability import write_json_atomic

    try:
        write_json_atomic(Path(loaded.step_path) / CURVE_CACHE, _curve_key(loaded) | {"curve": curve.to_dict()})
    except OSError:
        pass


def curve_loaded(loaded: Loaded, page_size: int = 16):
    """The loaded checkpoint's price curve: its prices record's `curve` when it carries one (an
    export), else the step directory's cached one (CURVE_CACHE), else sampled on the run's training
    batches before its step (as `calibrate_loaded` calibrates), with progress on stderr, and kept in
    the record and the cache."""
    from ..inference.serve_budget import PRICE_GRID, PriceCurve
    from ..training import data as data_mod
    from ..progress import Progress

    if (loaded.prices or {}).get("curve") is not None:
        return PriceCurve.from_dict(loaded.prices["curve"])
    cached = _cached_curve(loaded)
    if cached is not None:
        loaded.prices = dict(loaded.prices or {}, curve=cached.to_dict())
        return cached
    if not is_priced(loaded.model.config):
        raise EvaluationSetupError("targets need a TriRoute model with a budget (its routing is what prices move). "
                                   "Fix: serve without --target-flops/--target-mem.")
    if loaded.step == 0:
        raise EvaluationSetupError(f"{loaded.step_path} is at step 0: no trained batch to sample the price curve on. "
                                   "Fix: serve a checkpoint of a later step.")
    with run_datasets(loaded) as (run, dp, train, _):
        batches = data_mod.calibration_batches(train, run, loaded.step, dp)
    curve = curve_model(loaded.model, batches, page_size, Progress(len(PRICE_GRID), "prices", "price curve"))
    loaded.prices = dict(loaded.prices or {}, curve=curve.to_dict())
    _keep_curve(loaded, curve)
    return curve


def serve_curve(loaded: Loaded, targets: list[tuple[float | None, float | None]], warn: Callable[[str], None],
                page_size: int = 16):
    """Before serving requests with `targets` ((FLOPs, memory) pairs, None: the model's own): the
    price curve (None when no request has a target), each target checked against it
    (serve_budget.InfeasibleTargetError names the reachable range). Says through `warn` when the
    curve must first be sampled because the checkpoint carries none."""
    from ..inference.serve_budget import PRICE_GRID

    if all(t is None for pair in targets for t in pair):
        return None
    if (loaded.prices or {}).get("curve") is None and is_priced(loaded.model.config) and _cached_curve(loaded) is None:
        warn(f"the checkpoint carries no price curve: sampling it on the run's training batches before step "
             f"{loaded.step} ({len(PRICE_GRID)} evaluations of the calibration batches; kept in "
             f"{Path(loaded.step_path) / CURVE_CACHE} for the next time)")
    curve = curve_loaded(loaded, page_size)
    for pair in targets:
        for r, target in enumerate(pair):
            if target is not None:
                curve.check(r, target)
    return curve


def score_at_targets(loaded: Loaded, curve, targets: tuple[float | None, float | None]) -> None:
    """Leaves on the loaded model the prices `curve` gives `targets` (None: the model's own), what
    scoring serves a budget with: teacher-forced scoring generates no tokens, so no per-request
    control corrects them. `curve` None (no target): the prices stay."""
    if curve is None:
        return
    from ..inference.serve_budget import RequestBudget

    served = RequestBudget(curve, targets, loaded.model.host_prices(), control=False).prices
    loaded.model.prices.copy_(torch.tensor(served, dtype=torch.float64))


def calibrate_loaded(loaded: Loaded, page_size: int = 16) -> dict:
    """Calibrate the loaded checkpoint's prices on the run's training batches before its step;
    updates `loaded.prices` (the record) and returns calibrate_prices' record."""
    from ..training import data as data_mod

    if loaded.step == 0:
        raise EvaluationSetupError(f"{loaded.step_path} is at step 0: no trained batch to calibrate the prices on. "
                                   "Fix: serve a checkpoint of a later step.")
    with run_datasets(loaded) as (run, dp, train, _):
        batches = data_mod.calibration_batches(train, run, loaded.step, dp)
    calibration = calibrate_model(loaded.model, loaded.dual, batches, page_size)
    loaded.prices = prices_record(loaded.model.prices, calibration, loaded.step)
    return calibration


def serve_prices(loaded: Loaded, calibrate: bool, fix: str, warn: Callable[[str], None],
                 page_size: int = 16) -> dict | None:
    """Before serving: calibrate the prices when asked (a budgeted TriRoute model only; returns
    calibrate_prices' record), and say through `warn` what the served prices are when they are
    uncalibrated or miss a target (`fix`: the tool's way to calibrate)."""
    config = loaded.model.config
    calibration = calibrate_loaded(loaded, page_size) if calibrate and is_priced(config) else None
    message = price_warning(config, loaded.prices, loaded.step, fix)
    if message is not None:
        warn(message)
    return calibration
