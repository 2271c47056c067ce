"""PP=2 through Megatron's pipeline schedule equals PP=1 (losses, gradients, budget multipliers)."""

import re

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.model.harness import batch, build, tiny_triroute


def _micro_batches(cfg):
    from megatron_triroute.training.engine import MicroBatch

    out = []
    for i in range(2):
        tokens, labels, idx = batch(cfg, n=2, seed=10 + i, offset=2 * i)
        out.append(MicroBatch(tokens, labels, torch.ones_like(tokens, dtype=torch.float), idx))
    return out


def _step(model, groups, cfg, steps=2):
    from megatron_triroute.training.engine import TrainEngine

    engine = TrainEngine(model, groups, torch.optim.AdamW(model.parameters(), lr=1e-2), total_steps=10)
    reports = [engine.train_step(_micro_batches(cfg), step) for step in range(steps)]
    return reports


def _global_name(name, offset):
    return re.sub(r"decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)


def _worker(rank, world_size):
    from megatron.core import parallel_state

    from megatron_triroute.parallel import destroy_parallel

    cfg = tiny_triroute()
    # Reference: PP=1 (both ranks are data-parallel replicas fed the same batch).
    ref, groups = build(cfg, pp=1, seed=5)
    init = {k: v.clone() if torch.is_tensor(v) else v for k, v in ref.state_dict().items()}
    ref_reports = _step(ref, groups, cfg)
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    destroy_parallel()

    model, groups = build(cfg, pp=2, seed=5)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    offset = stage * cfg.model.n_layers // 2
    own = model.state_dict()
    model.load_state_dict({k: init[_global_name(k, offset)] for k in own})
    reports = _step(model, groups, cfg)
    for a, b in zip(ref_reports, reports):
        assert abs(a.loss - b.loss) < 1e-5, (a.loss, b.loss)
        assert abs(a.grad_norm - b.grad_norm) < 1e-5
        assert a.lambdas == pytest.approx(b.lambdas, abs=1e-9) and a.realised == pytest.approx(b.realised, abs=1e-9)
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, ref_grads[_global_name(name, offset)], atol=1e-5), name
    lam = model.budget.lambdas.clone()
    peers = [torch.zeros_like(lam) for _ in range(2)]
    dist.all_gather(peers, lam)
    assert torch.equal(peers[0], peers[1])  # both stages hold the same multipliers
    assert reports[-1].lambdas[0] > 0 or reports[-1].lambdas[1] > 0  # the budget was active


@pytest.mark.distributed
def test_pp2_schedule_matches_pp1():
    run_distributed(_worker, 2, timeout=300)
