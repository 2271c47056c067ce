import pytest
import torch

from tests.dist_utils import run_distributed


def _worker(rank, world_size):
    import torch.distributed as dist

    from megatron_triroute import TriRouteController
    from megatron_triroute.routing.noise import NoiseKey
    from megatron_triroute.routing.running_stats import commit_running_statistics
    from tests.routing.helpers import make_inputs, tiny_config

    cfg = tiny_config()
    torch.manual_seed(0)
    local = TriRouteController(cfg, 0).train()
    torch.manual_seed(0)
    union = TriRouteController(cfg, 0).train()
    hidden, side = make_inputs(cfg, batch=4, seed=9)
    T = cfg.model.seq_len
    for step in range(3):
        key = NoiseKey(1, step, 0, torch.arange(4), torch.arange(T))
        out = union(hidden, side, key)
        (out.attn.y.sum() + out.bits.y.pow(2).sum() + out.experts.weight.sum()).backward()
        commit_running_statistics([union])
        mine = slice(2 * rank, 2 * rank + 2)  # this rank's half of the global batch
        key = NoiseKey(1, step, 0, torch.arange(4)[mine], torch.arange(T))
        out = local(hidden[mine], side[mine], key)
        (out.attn.y.sum() + out.bits.y.pow(2).sum() + out.experts.weight.sum()).backward()
        commit_running_statistics([local], lambda t: dist.all_reduce(t))
    for (name, a), (_, b) in zip(local.named_buffers(), union.named_buffers()):
        peers = [torch.zeros_like(a) for _ in range(world_size)]
        dist.all_gather(peers, a)
        assert torch.equal(peers[0], peers[1]), name
        assert torch.allclose(a.double(), b.double(), atol=1e-6, rtol=1e-6), name
    assert local.balance["attn"].rho.item() != 1.0
    assert local.heads["bits"].whiten.steps.item() == 3


@pytest.mark.distributed
def test_router_statistics_are_identical_on_ranks_and_equal_the_union_batch():
    run_distributed(_worker, 2)
