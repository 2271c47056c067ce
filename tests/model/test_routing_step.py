"""The routing step's evaluation pass (model/routing_step.py): the step's statistics are set aside
and come back unchanged, the pass's own are read apart, its prices are in force only inside it,
and the model leaves it in train mode, also when the pass raises."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from megatron_triroute.config import TriRouteConfig
from megatron_triroute.model.routing_step import RouterStatistics, RoutingStep
from megatron_triroute.routing.budget import BudgetController

ONE_RANK = SimpleNamespace(dp=1, pp=1)


def _routing_step():
    cfg = TriRouteConfig().validate()
    stats = RouterStatistics(cfg)
    return RoutingStep(nn.Linear(2, 2), cfg, BudgetController(cfg.budget), stats), stats


def test_an_evaluation_pass_keeps_the_steps_statistics_apart_and_prices_only_inside_it():
    routing, stats = _routing_step()
    step_sums = torch.arange(stats.sums.numel(), dtype=torch.float64).view_as(stats.sums)
    stats.sums.copy_(step_sums)
    with routing.evaluation([0.5, -0.25]):
        state = routing.state
        assert not routing.model.training and state.should_record(training=False)
        assert state.prices.dtype == torch.float64 and state.prices.tolist() == [0.5, -0.25]
        assert stats.sums.abs().sum() == 0  # the pass starts from nothing
        stats.sums[0, 0] += 7.0
        assert torch.equal(routing.statistics(ONE_RANK), stats.sums) and routing.statistics(ONE_RANK)[0, 0] == 7.0
    assert torch.equal(stats.sums, step_sums)
    assert routing.model.training and routing.state.prices is None
    assert not routing.state.should_record(training=False) and routing.state.should_record(training=True)


def test_a_failing_pass_still_restores_the_step():
    routing, stats = _routing_step()
    stats.sums.fill_(3.0)
    with pytest.raises(RuntimeError, match="inside"):
        with routing.evaluation():
            stats.sums.fill_(1.0)
            raise RuntimeError("inside")
    assert bool((stats.sums == 3.0).all()) and routing.model.training
    assert routing.state.prices is None and not routing.state.record_eval


def test_realised_fractions_sum_every_layer_by_hand():
    _, stats = _routing_step()
    sl = stats.slices()
    sums = torch.zeros_like(stats.sums)
    sums[0, sl["cost"]] = torch.tensor([1.0, 2.0], dtype=torch.float64)
    sums[1, sl["cost"]] = torch.tensor([3.0, 1.0], dtype=torch.float64)
    sums[0, sl["dense"]] = torch.tensor([4.0, 4.0], dtype=torch.float64)
    sums[1, sl["dense"]] = torch.tensor([6.0, 8.0], dtype=torch.float64)
    assert stats.realised(sums) == [4.0 / 10.0, 3.0 / 12.0]
