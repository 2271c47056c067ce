"""Checkpoints of the per-rank format (written before layout-independent checkpoints, by the
ZeRO-1 AdamW of that time: name-keyed whole moments) still resume on their layout on the
distributed optimizer: model, moments and scheduler exactly; their legacy budget `targets` entry
is ignored."""

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.model.harness import batch, build, tiny_triroute

pytestmark = pytest.mark.distributed


def _setup(seed, legacy: bool):
    """The harness model with torch's AdamW, the optimizer of a one-rank ZeRO-1 run (`legacy`), or
    the run's engine (parallel/dp_engine.py)."""
    from megatron_triroute.parallel.dp_engine import build_dp_engine
    from megatron_triroute.training.engine import MicroBatch, TrainEngine
    from megatron_triroute.training.recipes import get_recipe

    cfg = tiny_triroute()
    model, groups = build(cfg, seed=seed)
    run = get_recipe("tiny")
    run.optim.weight_decay, run.optim.lr = 0.0, 1e-2
    if legacy:
        # torch's fused AdamW: the arithmetic the run's engine steps with on the CPU
        # (parallel/megatron_distopt.fuse_adamw), so the resumed step can be compared bit for bit.
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(run.optim.beta1, run.optim.beta2),
                                      eps=run.optim.eps, weight_decay=0.0, fused=True)
        grad_sync = None  # the flat all-reduce
    else:
        optimizer, grad_sync = build_dp_engine(model, run, groups)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer if legacy else optimizer.optimizer,
                                                  lambda s: 1.0 / (s + 1))
    engine = TrainEngine(model, groups, optimizer, 10, 1.0, scheduler, grad_sync=grad_sync)
    tokens, labels, idx = batch(cfg, n=2, seed=1)
    mbs = [MicroBatch(tokens, labels, torch.ones_like(tokens, dtype=torch.float), idx)]
    return cfg, model, groups, optimizer, scheduler, engine, mbs


def _worker(rank, world_size, root):
    import torch.distributed as dist

    from megatron_triroute.checkpoint import capture_rng_state, save_checkpoint
    from megatron_triroute.parallel import destroy_parallel
    from megatron_triroute.training.config import RunConfig
    from megatron_triroute.training.run_state import load_run

    cfg, model, groups, optimizer, scheduler, engine, mbs = _setup(seed=5, legacy=True)
    engine.train_step(mbs, 0)
    names = {id(p): n for n, p in model.named_parameters()}
    legacy_state = {"state": {names[id(p)]: s for p, s in optimizer.state.items()},  # ZeRO-1's name-keyed form
                    "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]}
    model_state = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    model_state["budget.targets"] = torch.tensor([0.5, 0.4], dtype=torch.float64)  # as old checkpoints hold
    state = {"model": model_state, "optimizer": legacy_state, "scheduler": scheduler.state_dict(),
             "rng": capture_rng_state()}
    meta = {"step": 1, "consumed_samples": 2, "config": RunConfig().to_dict(),
            "layout": {"world_size": 1, "tp": 1, "pp": 1, "ep": 1, "dp": 1}, "coordinates": [[0, 0, 0, 0]]}
    save_checkpoint(root, 1, state, meta, rank=0, world_size=1, barrier=dist.barrier)
    expected_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected_next = engine.train_step(mbs, 1).loss
    expected_after = {n: p.detach().clone() for n, p in model.named_parameters()}
    destroy_parallel()

    cfg, model, groups, optimizer, scheduler, engine, mbs = _setup(seed=99, legacy=False)
    loaded = load_run(root, model, optimizer, scheduler, groups)
    assert loaded["step"] == 1
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), expected_params[name]), name
    assert scheduler.last_epoch == 1
    # The next step uses the restored moments: the same loss and, after it, the same parameters.
    assert engine.train_step(mbs, 1).loss == expected_next
    optimizer.sync_params()
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), expected_after[name]), name
    destroy_parallel()


def test_a_per_rank_format_checkpoint_resumes(tmp_path):
    run_distributed(_worker, 1, str(tmp_path / "ckpt"), timeout=200)
