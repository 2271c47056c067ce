"""reduce_gradients: with DP=2 (EP=1 and EP=2), dense and expert grads equal one process on the union batch."""

import pytest

from tests.dist_utils import run_distributed

D_MODEL, D_EXPERT, NUM_EXPERTS, TOKENS_PER_RANK = 8, 12, 4, 6
TOL = dict(rtol=0, atol=1e-6)


def _tiny_moe_model(groups):
    """Dense projection and router, TriRoute experts fed by the router's weights, a norm on top."""
    import torch
    from torch import nn

    from megatron_triroute.experts import TriRouteExperts

    class TinyMoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(D_MODEL, D_MODEL)
            self.router = nn.Linear(D_MODEL, 2, bias=False)
            self.moe = TriRouteExperts(D_MODEL, D_EXPERT, NUM_EXPERTS, groups, top_k=2)
            self.norm = nn.LayerNorm(D_MODEL)

        def forward(self, x, expert_index):  # (N, d), (N, 2) -> (N, d)
            h = self.proj(x)
            expert_weight = torch.softmax(self.router(h), dim=-1)  # gradients reach the router via the gates
            return self.norm(h + self.moe(h, expert_index, expert_weight))

    torch.manual_seed(2024)
    return TinyMoE()


def _union_batch():
    import torch

    generator = torch.Generator().manual_seed(7)
    n = 2 * TOKENS_PER_RANK
    x = torch.randn(n, D_MODEL, generator=generator)
    index = torch.randint(-1, NUM_EXPERTS, (n, 2), generator=generator)
    index[3] = -1  # a token that skips the FFN on rank 0
    target = torch.randn(n, D_MODEL, generator=generator)
    return x, index, target


def _loss(model, x, index, target):
    return (model(x, index) - target).square().sum(dim=1).mean()


def _check_reduce_matches_union_batch(rank, world_size):
    import torch

    from megatron_triroute.parallel import destroy_parallel, initialize_parallel, reduce_gradients

    x, index, target = _union_batch()
    reference = _tiny_moe_model(None)
    _loss(reference, x, index, target).backward()  # one process, the union batch, all experts
    expected = dict(reference.named_parameters())
    mine = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)

    for ep in (1, 2):
        groups = initialize_parallel(expert_parallel=ep)
        assert (groups.dp, groups.ep, groups.edp) == (2, ep, 2 // ep)
        model = _tiny_moe_model(groups)
        _loss(model, x[mine], index[mine], target[mine]).backward()
        reduce_gradients(model, groups)

        first = groups.ep_rank * model.moe.num_local_experts
        checked = 0
        for name, param in model.named_parameters():
            want = expected[name].grad
            if not getattr(param, "allreduce", True):  # a stacked expert weight: the reference's rows of this rank's experts
                want = want[first:first + model.moe.num_local_experts]
            assert param.grad is not None, name
            torch.testing.assert_close(param.grad, want, **TOL, msg=f"ep={ep} {name}")
            checked += 1
        assert checked == 2 + 1 + 3 + 2
        destroy_parallel()


@pytest.mark.distributed
def test_reduced_grads_equal_union_batch_for_ep1_and_ep2():
    run_distributed(_check_reduce_matches_union_batch, 2)


def _graded_parameters():
    """Six parameters of every norm part (TP-sharded, replicated, expert) with known gradients."""
    import torch

    params = []
    for i in range(6):
        p = torch.nn.Parameter(torch.zeros(3, i + 1))
        p.grad = torch.arange(3.0 * (i + 1)).view(3, i + 1) - i
        if i % 3 == 0:
            p.tensor_model_parallel = True
        elif i % 3 == 2:
            p.allreduce = False
        params.append(p)
    return params


def test_norm_parts_are_each_parts_sum_of_squares():
    import torch

    from megatron_triroute.parallel.grad_reduce import norm_part, norm_parts

    params = _graded_parameters()
    expected = torch.zeros(3, dtype=torch.float64)
    for p in params:  # the per-tensor reference: fp64 sum of squares added to the parameter's part
        expected[norm_part(p)] += (p.grad.double() ** 2).sum()
    assert [norm_part(p) for p in params] == [0, 1, 2, 0, 1, 2]
    got = norm_parts([(p, p.grad) for p in params], torch.device("cpu"))
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected, rtol=1e-15, atol=0)
    alone = norm_parts([(params[1], params[1].grad)], torch.device("cpu"))  # one replicated tensor
    torch.testing.assert_close(alone, torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64) * (params[1].grad.double() ** 2).sum())


def test_scale_gradients_scales_every_tensor():
    import torch

    from megatron_triroute.parallel.grad_reduce import scale_gradients

    params = _graded_parameters()
    before = [p.grad.clone() for p in params]
    scale_gradients([p.grad for p in params], 0.25)
    for p, b in zip(params, before):
        torch.testing.assert_close(p.grad, b * 0.25, rtol=0, atol=0)


def test_norm_parts_cut_only_large_cpu_gradients_into_pieces():
    """A CPU gradient above NORM_SPLIT elements is cut into NORM_CHUNK pieces (its fp64 copy kept in
    cache); one between NORM_CHUNK and NORM_SPLIT goes whole (no split op for it). Both give the
    fp64 sum of squares."""
    import torch

    from megatron_triroute.parallel.grad_reduce import NORM_CHUNK, NORM_SPLIT, norm_parts
    from tests.dispatched import DispatchedOps

    g = torch.Generator().manual_seed(0)
    for numel, cut in ((NORM_CHUNK + NORM_CHUNK // 2, False), (NORM_SPLIT + 1, True)):
        p = torch.nn.Parameter(torch.zeros(numel))
        p.grad = torch.randn(numel, generator=g)
        with DispatchedOps() as ops:
            got = norm_parts([(p, p.grad)], torch.device("cpu"))
        assert ops.names.count("split") == int(cut)
        torch.testing.assert_close(got[1], (p.grad.double() ** 2).sum(), rtol=1e-12, atol=0)
