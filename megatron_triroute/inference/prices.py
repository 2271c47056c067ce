"""The prices record: whether and when a checkpoint's deployed prices were calibrated.

Every checkpoint's meta (`training/run_state.save_run`) and every export's config.json carry

    "prices": {"calibrated": bool,        # set by a budget calibration (training/calibrate.py)
               "step": int | None,        # the checkpoint step they were calibrated at
               "feasible": [bool, bool] | None,  # per resource (FLOPs, memory): the target was met;
                                          # None when not calibrated
               "prices": [mu_flops, mu_mem],
               "curve": {...}}            # optional: the price curve (serve_budget.PriceCurve.to_dict),
                                          # what per-request targets are met by; sampled at load when absent

A run calibrates its prices once, at its normal end, so its mid-run checkpoints (periodic and
requeue saves) hold prices 0: they serve the plain argmax policy, which the budget does not hold.
The serving tools say so (`unpriced_warning`) and can calibrate them (`--calibrate`,
evaluation/calibration.py). Checkpoints written before the record existed have none:
`read_prices_record` infers it from the prices (nonzero prices come only from a calibration).
"""

from __future__ import annotations

import torch

from ..config import TriRouteConfig


def is_priced(config: TriRouteConfig) -> bool:
    """A TriRoute model with a budget: its deployed policy needs calibrated prices."""
    return config.router.kind == "triroute" and config.budget.enabled


def prices_record(prices: torch.Tensor, calibration: dict | None, step: int) -> dict:
    """The record of `prices` at checkpoint `step`; `calibration` is calibrate_prices' record when
    they were just calibrated, None otherwise."""
    return {"calibrated": calibration is not None, "step": step if calibration is not None else None,
            "feasible": list(calibration["feasible"]) if calibration is not None else None,
            "prices": [float(p) for p in prices]}


def read_prices_record(meta: dict, prices: torch.Tensor) -> dict:
    """A checkpoint's record (its meta's, or inferred for a checkpoint written before records)."""
    if meta.get("prices") is not None:
        return dict(meta["prices"])
    calibrated = bool(prices.ne(0).any())
    return {"calibrated": calibrated, "step": int(meta.get("step", 0)) if calibrated else None, "feasible": None,
            "prices": [float(p) for p in prices]}


def price_warning(config: TriRouteConfig, record: dict, step: int, fix: str) -> str | None:
    """What a tool serving this checkpoint must say about its prices (a budgeted TriRoute model
    only): never calibrated, or calibrated against a target the routing cannot reach; None when
    there is nothing to say. `fix` names the tool's way to calibrate (e.g. "pass --calibrate")."""
    if not is_priced(config):
        return None
    b = config.budget
    if not record.get("calibrated"):
        return (f"prices not calibrated (checkpoint written mid-run at step {step}): serving the plain argmax "
                f"policy, which is not held to the budget (FLOPs target {b.flops_target}, KV-memory target "
                f"{b.mem_target}). Fix: {fix} to calibrate them on the run's training data.")
    missed = [name for name, ok in zip(("FLOPs", "KV-memory"), record.get("feasible") or (True, True)) if not ok]
    if missed:
        return (f"the {' and '.join(missed)} target cannot be met (calibrated at step {record.get('step')}): the "
                "prices serve the cheapest policy the routing reaches, which is over the budget.")
    return None
