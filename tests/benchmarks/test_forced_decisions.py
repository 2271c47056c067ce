"""benchmarks/forced_decisions.py: the forced mix realises the budget by the cost model; the wrapper
returns the schedule and lets a follower reuse its leader's attention."""

import importlib.util
from pathlib import Path

import pytest
import torch

from megatron_triroute.systems import system_config
from megatron_triroute.training.recipes import get_recipe

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fd():
    spec = importlib.util.spec_from_file_location("forced_decisions", REPO / "benchmarks" / "forced_decisions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_forced_mix_realises_the_budget_by_the_cost_model(fd):
    """The mix drawn for TriRoute at 2,048 context realises FLOPs 0.55 and KV memory 0.40 of Dense by
    `hard_cost` (the earlier fixed mix realised 0.71: top-2 over half-width experts with a rare null
    route costs a dense FFN), and followers reuse their leader's attention."""
    cfg = system_config("triroute", get_recipe("160m").triroute.validate())
    context, calls, batch = 2048, 40, 2
    mix = fd.budget_mix(cfg, context)
    schedules = [fd.forced_schedule(cfg, mix, layer, calls, batch) for layer in range(cfg.model.n_layers)]
    positions = torch.full((batch, 1), context)
    steps = [(positions, [schedules[layer][c] for layer in range(cfg.model.n_layers)]) for c in range(calls)]
    realised = fd.realised_fractions(steps, cfg)
    assert realised["flops"] == pytest.approx(cfg.budget.flops_target, abs=0.005)
    assert realised["mem"] == pytest.approx(cfg.budget.mem_target, abs=0.005)
    seen = fd.measure_mix([outs for _, outs in steps], len(cfg.router.bits))
    for key in ("attn", "bits"):
        assert seen[key] == pytest.approx(mix[key], abs=0.01)
    leader = fd.ForcedController(Discarded(), cfg)
    leader.schedule = schedules[1][:1]
    out = leader(None, None, prev=schedules[0][0])
    assert torch.equal(out.attn.y, schedules[0][0].attn.y) and torch.equal(out.bits.y, schedules[1][0].bits.y)


class Discarded(torch.nn.Module):
    """A controller whose output the forced wrapper discards."""

    def forward(self, *args, **kwargs):
        return None
