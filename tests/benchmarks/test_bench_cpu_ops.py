"""benchmarks/bench_cpu_ops.py's head ranges: every head full, or the budget mix's modes."""

import torch

from benchmarks.forced_decisions import budget_mix
from megatron_triroute.training.recipes import get_recipe
from tests.benchmarks import load_benchmark


def test_mixed_heads_take_the_budget_mix_modes_and_their_first_keys():
    bench = load_benchmark("bench_cpu_ops")
    head_ranges, H = bench.head_ranges, bench.H
    context, batch = 2048, 64
    config = get_recipe("160m").triroute.validate()
    assert not head_ranges("full", 2, context, torch.Generator()).any()
    lo = head_ranges("mixed", batch, context, torch.Generator().manual_seed(0))
    assert lo.shape == (batch, H)
    skip, local, full = context, context - 1 - config.router.window, 0  # by hand: rows at position context - 1
    assert set(lo.unique().tolist()) == {skip, local, full}
    drawn = torch.tensor([(lo == v).float().mean() for v in (skip, local, full)])
    want = torch.tensor(budget_mix(config, context)["attn"], dtype=torch.float32)
    assert (drawn - want).abs().max() < 0.05, (drawn, want)
