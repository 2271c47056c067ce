"""The prices record (inference/prices.py): what a serving tool says about a checkpoint's prices."""

import torch

from megatron_triroute.config import TriRouteConfig
from megatron_triroute.inference.prices import price_warning, prices_record, read_prices_record
from megatron_triroute.systems import system_config

UNCALIBRATED = {"calibrated": False, "step": None, "feasible": None, "prices": [0.0, 0.0]}


def test_only_a_budgeted_triroute_model_with_uncalibrated_prices_is_warned_about():
    triroute = TriRouteConfig().validate()
    message = price_warning(triroute, UNCALIBRATED, 40, "pass --calibrate")
    assert "prices not calibrated (checkpoint written mid-run at step 40)" in message
    assert "plain argmax" in message and "Fix: pass --calibrate" in message
    for system in ("dense", "moe", "mod"):  # no budget, or another router family: nothing to calibrate
        assert price_warning(system_config(system, TriRouteConfig()).validate(), UNCALIBRATED, 40, "x") is None
    unbudgeted = TriRouteConfig()
    unbudgeted.budget.enabled = False
    assert price_warning(unbudgeted.validate(), UNCALIBRATED, 40, "x") is None
    calibrated = prices_record(torch.tensor([0.2, -0.1], dtype=torch.float64),
                               {"feasible": [True, True]}, 80)
    assert calibrated == {"calibrated": True, "step": 80, "feasible": [True, True], "prices": [0.2, -0.1]}
    assert price_warning(triroute, calibrated, 80, "x") is None
    missed = dict(calibrated, feasible=[False, True])
    assert "FLOPs target cannot be met (calibrated at step 80)" in price_warning(triroute, missed, 80, "x")


def test_a_checkpoint_written_before_the_record_is_judged_by_its_prices():
    assert read_prices_record({"step": 9}, torch.zeros(2, dtype=torch.float64)) == UNCALIBRATED
    legacy = read_prices_record({"step": 9}, torch.tensor([0.05, 0.0], dtype=torch.float64))
    assert legacy["calibrated"] is True and legacy["step"] == 9
    record = prices_record(torch.zeros(2), None, 5)
    assert record == UNCALIBRATED and read_prices_record({"step": 5, "prices": record}, torch.ones(2)) == record
