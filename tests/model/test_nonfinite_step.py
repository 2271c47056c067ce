"""A non-finite loss skips the whole step: no optimizer, router-statistic or multiplier update."""

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.model.harness import batch, build, tiny_triroute


def _worker(rank, world_size):
    import megatron_triroute.training.engine as engine_mod
    from megatron_triroute.training.engine import MicroBatch, TrainEngine

    cfg = tiny_triroute()
    model, groups = build(cfg, seed=6)
    engine = TrainEngine(model, groups, torch.optim.AdamW(model.parameters(), lr=1e-2), total_steps=10)
    tokens, labels, idx = batch(cfg, n=2, seed=2)
    mbs = [MicroBatch(tokens, labels, torch.ones_like(tokens, dtype=torch.float), idx)]
    engine.train_step(mbs, 0)  # one good step so every statistic has moved once
    state = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    optimizer_steps = engine.optimizer.state[next(iter(model.parameters()))]["step"].clone()

    good_loss = engine_mod._loss
    engine_mod._loss = lambda out, mb: good_loss(out * float("nan"), mb)
    try:
        report = engine.train_step(mbs, 1)
    finally:
        engine_mod._loss = good_loss
    assert report.skipped and report.loss != report.loss  # nan
    after = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    for name, value in state.items():  # parameters, whitening, rho, lambda, EMA: all untouched
        assert torch.equal(value, after[name]), name
    assert torch.equal(engine.optimizer.state[next(iter(model.parameters()))]["step"], optimizer_steps)
    assert model.router_statistics.sums.abs().sum() == 0 and model.budget._acc.abs().sum() == 0
    from megatron_triroute.routing.running_stats import running_statistics

    stats = running_statistics([model])
    assert stats and all(stat.pending().abs().sum() == 0 for stat in stats)  # accumulators dropped
    report = engine.train_step(mbs, 2)  # and training goes on
    assert not report.skipped and report.loss == report.loss


@pytest.mark.distributed
def test_nonfinite_loss_skips_the_step_entirely():
    run_distributed(_worker, 1)
