"""ZeRO-1 sharded AdamW equals the replicated optimizer bit for bit, with each replica holding only
its share of the state (dense over data parallel, experts over expert-data parallel)."""

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.model.harness import batch, build, tiny_triroute


def _train(sharded: bool, ep: int, rank: int):
    from megatron_triroute.parallel import destroy_parallel
    from megatron_triroute.training.engine import MicroBatch, TrainEngine
    from megatron_triroute.training.zero import ShardedAdamW

    cfg = tiny_triroute()
    model, groups = build(cfg, ep=ep, seed=8)
    if sharded:
        opt = ShardedAdamW([{"params": list(model.named_parameters()), "weight_decay": 0.1}], groups, lr=1e-2)
    else:
        opt = torch.optim.AdamW([{"params": list(model.parameters()), "weight_decay": 0.1}], lr=1e-2)
    engine = TrainEngine(model, groups, opt, total_steps=10)
    for step in range(3):
        tokens, labels, idx = batch(cfg, n=2, seed=60 + 2 * step + rank, offset=2 * (2 * step + rank))
        engine.train_step([MicroBatch(tokens, labels, torch.ones_like(tokens, dtype=torch.float), idx)], step)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    held = sum(1 for s in (opt.optimizer.state if sharded else opt.state).values() if s)
    owned = opt.owned_names() if sharded else None
    destroy_parallel()
    return params, held, owned, len(params)


def _worker(rank, world_size, ep):
    replicated, held_all, _, n = _train(False, ep, rank)
    sharded, held, owned, _ = _train(True, ep, rank)
    for name in replicated:
        assert torch.equal(replicated[name], sharded[name]), name
    assert held_all == n and 0 < held < n  # this replica keeps only its share of the moments
    everyone = [None] * world_size
    dist.all_gather_object(everyone, owned)
    expert = [name for name in replicated if "deepspeed_experts" in name]
    dense = [name for name in replicated if name not in expert]
    owners = [name for names in everyone for name in names]
    assert sorted(n for n in owners if n in dense) == sorted(dense)  # every dense parameter exactly once
    if ep == 2:  # each rank holds different experts and is their only replica: it owns them all
        assert all(name in owned for name in expert)


@pytest.mark.distributed
@pytest.mark.parametrize("ep", [1, 2])
def test_sharded_adamw_equals_replicated(ep):
    run_distributed(_worker, 2, ep, timeout=240)
