"""TP=2 x EP=2 on 4 processes trains like TP=1 x EP=1 on one."""

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.model.harness import batch, build, tiny_triroute

STEPS = 3


def _micro_batch(cfg, i):
    from megatron_triroute.training.engine import MicroBatch

    tokens, labels, idx = batch(cfg, n=2, seed=40 + i, offset=2 * i)
    return MicroBatch(tokens, labels, torch.ones_like(tokens, dtype=torch.float), idx)


def _losses(cfg, model, groups, dp_rank, dp):
    from megatron_triroute.training.engine import TrainEngine

    engine = TrainEngine(model, groups, torch.optim.AdamW(model.parameters(), lr=3e-3), total_steps=10)
    out = []
    for step in range(STEPS):
        mbs = [_micro_batch(cfg, 2 * step + i) for i in range(2)][dp_rank::dp]
        out.append(engine.train_step(mbs, step).loss)
    return out


def _reference(rank, world_size, path):
    cfg = tiny_triroute()
    model, groups = build(cfg, seed=3)
    torch.save(torch.tensor(_losses(cfg, model, groups, 0, 1), dtype=torch.float64), path)


def _tp_ep(rank, world_size, path):
    cfg = tiny_triroute()
    model, groups = build(cfg, tp=2, ep=2, seed=3)
    assert (groups.tp, groups.ep, groups.dp) == (2, 2, 2)
    losses = torch.tensor(_losses(cfg, model, groups, groups.dp_rank, groups.dp), dtype=torch.float64)
    ref = torch.load(path, weights_only=True)
    assert torch.allclose(losses, ref, atol=1e-5, rtol=0), (losses, ref)


@pytest.mark.distributed
def test_tp2_ep2_losses_match_single_process(tmp_path):
    path = str(tmp_path / "ref.pt")
    run_distributed(_reference, 1, path, timeout=240)
    run_distributed(_tp_ep, 4, path, timeout=400)
