"""DP=2: statistics and multipliers bit-identical on both ranks and equal to one process on the
union batch; expert gradients reduced over the right group (EP=1 and EP=2)."""

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from tests.model.harness import batch, build, by_global_expert, tiny_triroute


def _micro_batch(cfg, i):
    from megatron_triroute.training.engine import MicroBatch

    tokens, labels, idx = batch(cfg, n=2, seed=20 + i, offset=2 * i)
    return MicroBatch(tokens, labels, torch.ones_like(tokens, dtype=torch.float), idx)


def _train(cfg, model, groups, batches_per_step):
    from megatron_triroute.training.engine import TrainEngine

    engine = TrainEngine(model, groups, torch.optim.SGD(model.parameters(), lr=0.1), total_steps=10, clip_grad=0.0)
    reports = [engine.train_step(mbs, step) for step, mbs in enumerate(batches_per_step)]
    whiten = torch.cat([b.flatten().double() for n, b in model.named_buffers() if "whiten" in n or n.endswith("rho")])
    return reports, whiten


def _reference(rank, world_size, path):
    cfg = tiny_triroute()
    model, groups = build(cfg, seed=9)
    steps = [[_micro_batch(cfg, 2 * s), _micro_batch(cfg, 2 * s + 1)] for s in range(2)]
    reports, whiten = _train(cfg, model, groups, steps)
    grads = {k: g.clone() for n, p in model.named_parameters() for k, g in by_global_expert(n, p.grad, 0).items()}
    torch.save({"lambdas": [r.lambdas for r in reports], "realised": [r.realised for r in reports],
                "stats": [r.statistics for r in reports], "whiten": whiten, "grads": grads,
                "loss": [r.loss for r in reports]}, path)


def _data_parallel(rank, world_size, path, ep):
    cfg = tiny_triroute()
    ref = torch.load(path, weights_only=True)
    model, groups = build(cfg, ep=ep, seed=9)
    steps = [[_micro_batch(cfg, 2 * s + rank)] for s in range(2)]  # each rank: its half of the global batch
    reports, whiten = _train(cfg, model, groups, steps)
    for i, r in enumerate(reports):
        mine = torch.cat([torch.tensor(r.lambdas), torch.tensor(r.realised), r.statistics.flatten(), whiten])
        peers = [torch.zeros_like(mine) for _ in range(2)]
        dist.all_gather(peers, mine)
        assert torch.equal(peers[0], peers[1]), "ranks disagree"
        assert torch.allclose(torch.tensor(r.lambdas), torch.tensor(ref["lambdas"][i]), atol=1e-6, rtol=0)
        assert torch.allclose(torch.tensor(r.realised), torch.tensor(ref["realised"][i]), atol=1e-6, rtol=0)
        assert torch.allclose(r.statistics, ref["stats"][i], atol=1e-6, rtol=1e-9)
        assert abs(r.loss - ref["loss"][i]) < 1e-5
    assert torch.allclose(whiten, ref["whiten"], atol=1e-6, rtol=1e-6)
    assert any(l > 0 for l in reports[-1].lambdas)
    local = cfg.router.num_experts // ep
    for name, p in model.named_parameters():
        for key, grad in by_global_expert(name, p.grad, groups.ep_rank * local).items():
            expected = ref["grads"][key]
            assert torch.allclose(grad, expected, atol=1e-5), (key, (grad - expected).abs().max())


@pytest.mark.distributed
@pytest.mark.parametrize("ep", [1, 2])
def test_dp2_matches_one_process_on_the_union_batch(tmp_path, ep):
    path = tmp_path / "reference.pt"
    run_distributed(_reference, 1, str(path), timeout=240)
    run_distributed(_data_parallel, 2, str(path), ep, timeout=240)
