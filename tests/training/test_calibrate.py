"""End-of-training budget calibration (training/calibrate.py) on a tabular population whose
noise-free decisions are the argmax of priced logits, as in routing/pricing.py."""

import torch

from megatron_triroute.config import BudgetConfig
from megatron_triroute.routing.budget import BudgetController
from megatron_triroute.training.calibrate import calibrate_prices


def population(seed: int, n: int = 4000):
    g = torch.Generator().manual_seed(seed)
    cost = torch.tensor([0.1875, 0.3125, 0.5625, 1.0], dtype=torch.float64)  # per-option cost fractions
    logits = [torch.randn(n, 4, generator=g, dtype=torch.float64) * 0.5 + torch.tensor([0.0, 0.3, 0.6, 0.4],
                                                                                         dtype=torch.float64)
              for _ in range(2)]
    calls = []

    def realised_at(budget: BudgetController):
        def f(prices: list[float]):
            calls.append(list(prices))
            return [cost[(z - mu * cost).argmax(-1)].mean().item() for z, mu in zip(logits, prices)]
        return f
    return realised_at, calls


def controller(flops_target, mem_target, lambdas):
    b = BudgetController(BudgetConfig(flops_target=flops_target, mem_target=mem_target, dual_kp=0.0))
    b.lambdas.copy_(torch.tensor(lambdas, dtype=torch.float64))
    return b


def test_active_constraints_land_on_the_target_from_above_and_below():
    for seed in range(3):
        make, _ = population(seed)
        b = controller(0.40, 0.70, [0.3, 0.2])  # both active; unpriced cost ~0.6: above 0.40, below 0.70
        rec = calibrate_prices(b, make(b))
        assert rec["realised_before"][0] > 0.40 + 0.05 and rec["realised_before"][1] < 0.70 - 0.05
        assert rec["prices"][0] > 0 and rec["prices"][1] < 0  # lowered one, raised the other
        for r, target in enumerate((0.40, 0.70)):
            assert target - 0.01 <= rec["realised_after"][r] <= target + 1e-12, rec
        # The record's prices are the ones realised_after was measured at; the budget is only read.
        assert make(b)(rec["prices"]) == rec["realised_after"]
        assert torch.equal(b.prices, torch.zeros(2, dtype=torch.float64))


def test_inactive_constraint_under_budget_keeps_the_plain_argmax():
    make, _ = population(0)
    b = controller(0.40, 0.90, [0.3, 0.0])  # memory inactive (lambda 0) and under its target
    rec = calibrate_prices(b, make(b))
    assert rec["prices"][1] == 0.0 and rec["realised_after"][1] == rec["realised_before"][1] < 0.90
    assert rec["realised_after"][0] <= 0.40


def test_inactive_constraint_over_budget_is_still_met():
    make, _ = population(1)
    b = controller(0.30, 0.90, [0.0, 0.0])  # nothing active, but FLOPs above target: never exceed it
    rec = calibrate_prices(b, make(b))
    assert rec["prices"][0] > 0 and 0.29 <= rec["realised_after"][0] <= 0.30


def test_nothing_to_do_costs_one_evaluation_per_phase():
    make, calls = population(2)
    b = controller(0.95, 0.95, [0.0, 0.0])
    rec = calibrate_prices(b, make(b))
    assert rec["prices"] == [0.0, 0.0]
    assert len(calls) <= 3


def test_a_resource_no_decision_prices_is_left_alone():
    make, calls = population(0)
    b = controller(0.40, 0.40, [0.3, 0.3])  # both above target and active, but memory cannot move
    rec = calibrate_prices(b, make(b), movable=(True, False))
    assert rec["prices"][1] == 0.0 and all(c[1] == 0.0 for c in calls)
    assert 0.39 <= rec["realised_after"][0] <= 0.40


def step_function(floor: float, knee: float, calls: list | None = None):
    """realised_at for a FLOPs cost that falls linearly with the price, 0.9 at 0 to `floor` at
    `knee`, flat above (the cheapest option everywhere); memory fixed at 0.3."""
    def make(budget: BudgetController):
        def f(prices: list[float]):
            mu = float(prices[0])
            if calls is not None:
                calls.append(mu)
            return [max(floor, 0.9 - (0.9 - floor) * max(mu, 0.0) / knee), 0.3]
        return f
    return make


def test_an_infeasible_target_is_reported_and_its_price_capped_where_the_floor_is_reached(caplog):
    # Floor 0.6 reached at price 3.0, target 0.4 below it: by hand, no price meets 0.4; the lowest
    # fraction is 0.6, and the smallest price reaching it is 3.0 (bisection resolution (4-2)/2^14).
    calls = []
    b = controller(0.40, 0.70, [0.5, 0.0])
    with caplog.at_level("WARNING", logger="megatron_triroute.training.calibrate"):
        rec = calibrate_prices(b, step_function(0.6, 3.0, calls)(b))
    assert rec["feasible"] == [False, True]
    assert abs(rec["realised_after"][0] - 0.6) < 1e-6 and rec["realised_after"][1] == 0.3
    assert 3.0 <= rec["prices"][0] <= 3.0 + 2.0 / 2**14 and rec["prices"][1] == 0.0
    assert max(calls) == 2.0**11  # the bracket's top was probed, then left
    message = caplog.text
    assert "flops target 0.4 cannot be met" in message and "0.6000" in message and "flops_target" in message


def test_a_feasible_target_is_feasible_and_silent(caplog):
    b = controller(0.70, 0.70, [0.5, 0.0])
    with caplog.at_level("WARNING", logger="megatron_triroute.training.calibrate"):
        rec = calibrate_prices(b, step_function(0.6, 3.0)(b))
    assert rec["feasible"] == [True, True] and 0.69 <= rec["realised_after"][0] <= 0.70
    assert "cannot be met" not in caplog.text


def test_an_unpriced_resource_over_its_target_is_infeasible(caplog):
    b = controller(0.70, 0.20, [0.5, 0.5])  # memory fixed at 0.3 > 0.2 and nothing routes it
    with caplog.at_level("WARNING", logger="megatron_triroute.training.calibrate"):
        rec = calibrate_prices(b, step_function(0.6, 3.0)(b), movable=(True, False))
    assert rec["feasible"] == [True, False] and rec["prices"][1] == 0.0
    assert "no routed decision prices mem" in caplog.text
