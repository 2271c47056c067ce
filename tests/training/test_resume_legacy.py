"""Checkpoints of the per-rank format (written before layout-independent checkpoints) still
resume on their layout: model, ZeRO-1 moments and scheduler exactly; their legacy budget `targets`
entry is ignored."""

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.model.harness import batch, build, tiny_triroute

pytestmark = pytest.mark.distributed


def _setup(seed):
    from megatron_triroute.training.engine import MicroBatch, TrainEngine
    from megatron_triroute.training.zero import ShardedAdamW

    cfg = tiny_triroute()
    model, groups = build(cfg, seed=seed)
    optimizer = ShardedAdamW([{"params": list(model.named_parameters()), "weight_decay": 0.0}], groups, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer.optimizer, lambda s: 1.0 / (s + 1))
    engine = TrainEngine(model, groups, optimizer, 10, 1.0, scheduler)
    tokens, labels, idx = batch(cfg, n=2, seed=1)
    mbs = [MicroBatch(tokens, labels, torch.ones_like(tokens, dtype=torch.float), idx)]
    return cfg, model, groups, optimizer, scheduler, engine, mbs


def _worker(rank, world_size, root):
    import torch.distributed as dist

    from megatron_triroute.checkpoint import capture_rng_state, save_checkpoint
    from megatron_triroute.parallel import destroy_parallel
    from megatron_triroute.training.config import RunConfig
    from megatron_triroute.training.run_state import load_run

    cfg, model, groups, optimizer, scheduler, engine, mbs = _setup(seed=5)
    engine.train_step(mbs, 0)
    model_state = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    model_state["budget.targets"] = torch.tensor([0.5, 0.4], dtype=torch.float64)  # as old checkpoints hold
    state = {"model": model_state, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "rng": capture_rng_state()}
    meta = {"step": 1, "consumed_samples": 2, "config": RunConfig().to_dict(),
            "layout": {"world_size": 1, "tp": 1, "pp": 1, "ep": 1, "dp": 1}, "coordinates": [[0, 0, 0, 0]]}
    save_checkpoint(root, 1, state, meta, rank=0, world_size=1, barrier=dist.barrier)
    expected_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected_next = engine.train_step(mbs, 1).loss
    expected_after = {n: p.detach().clone() for n, p in model.named_parameters()}
    destroy_parallel()

    cfg, model, groups, optimizer, scheduler, engine, mbs = _setup(seed=99)
    loaded = load_run(root, model, optimizer, scheduler, groups)
    assert loaded["step"] == 1
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), expected_params[name]), name
    assert scheduler.last_epoch == 1
    # The next step uses the restored moments: the same loss and, after it, the same parameters.
    assert engine.train_step(mbs, 1).loss == expected_next
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), expected_after[name]), name
    destroy_parallel()



def test_a_per_rank_format_checkpoint_resumes(tmp_path):
    run_distributed(_worker, 1, str(tmp_path / "ckpt"), timeout=200)
