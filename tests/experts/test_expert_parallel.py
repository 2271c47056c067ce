"""Expert parallel (EP=2 on 2 gloo processes) equals all experts on one process (EP=1)."""

import pytest

from tests.dist_utils import run_distributed

D_MODEL, D_EXPERT, NUM_EXPERTS, TOP_K = 8, 12, 4, 2
TOL = dict(rtol=0, atol=1e-6)


def _routes(num_tokens: int, generator):
    """Random top-2 routes with null-expert (-1) routes, including tokens that pick null twice."""
    import torch

    index = torch.randint(-1, NUM_EXPERTS, (num_tokens, TOP_K), generator=generator)
    index[0] = torch.tensor([-1, -1])
    index[1, 0] = -1
    weight = torch.rand(num_tokens, TOP_K, generator=generator)
    return index, weight / weight.sum(dim=1, keepdim=True)


def _check_ep2_matches_ep1(rank: int, world_size: int) -> None:
    import torch
    import torch.distributed as dist

    from megatron_triroute.experts import TriRouteExperts, stacked, swiglu
    from megatron_triroute.parallel import destroy_parallel, initialize_parallel

    groups = initialize_parallel(expert_parallel=2)
    assert (groups.ep, groups.edp, groups.dp, groups.ep_rank) == (2, 1, 2, rank)

    torch.manual_seed(1234)
    reference = TriRouteExperts(D_MODEL, D_EXPERT, NUM_EXPERTS, top_k=TOP_K)  # all experts, no groups
    torch.manual_seed(1234)
    layer = TriRouteExperts(D_MODEL, D_EXPERT, NUM_EXPERTS, groups, top_k=TOP_K)
    assert layer.experts.num_local_experts == NUM_EXPERTS // 2
    first = groups.ep_rank * layer.num_local_experts
    local = slice(first, first + layer.num_local_experts)
    # Same seed, same expert weights whatever the EP size: no copying needed.
    everyone = dict(reference.experts.named_parameters())
    for name, param in layer.experts.named_parameters():
        assert param.shape[0] == NUM_EXPERTS // 2, name
        assert torch.equal(param, everyone[name][local]), name

    # Different token counts per rank: the no-drop capacity is the MAX over the EP group.
    generator = torch.Generator().manual_seed(100 + rank)
    num_tokens = 5 + 4 * rank
    x = torch.randn(num_tokens, D_MODEL, generator=generator)
    index, weight = _routes(num_tokens, generator)
    upstream = torch.randn(num_tokens, D_MODEL, generator=generator)

    def run(module):
        xs = x.clone().requires_grad_(True)
        ws = weight.clone().requires_grad_(True)
        module.zero_grad(set_to_none=True)
        out = module(xs, index, ws)
        (out * upstream).sum().backward()
        return out.detach(), xs.grad, ws.grad

    out, x_grad, w_grad = run(layer)
    ref_out, ref_x_grad, ref_w_grad = run(reference)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(x_grad, ref_x_grad, **TOL)
    torch.testing.assert_close(w_grad, ref_w_grad, **TOL)
    assert torch.equal(out[0], torch.zeros(D_MODEL))  # null twice: exactly zero across ranks too

    # An expert's grad on its owner sums the tokens of every rank in the EP group.
    union_grads = {name: p.grad.clone() for name, p in reference.moe.experts.named_parameters()}
    for grad in union_grads.values():
        dist.all_reduce(grad)  # every expert's grad over both ranks' tokens
    for name, param in layer.experts.named_parameters():
        torch.testing.assert_close(param.grad, union_grads[name][local], **TOL)

    # Skewed: every token of both ranks goes to expert 3 (owned by rank 1); nothing is dropped.
    skewed = torch.full((num_tokens, TOP_K), 3)
    skewed[:, 1] = -1
    rows = []
    with pytest.MonkeyPatch.context() as mp:  # each expert call's rows
        mp.setattr(stacked, "swiglu", lambda h, *w: rows.append(h.shape[-2]) or swiglu(h, *w))
        out = layer(x, skewed, weight)
    assert int(layer.moe.exp_counts[3]) == num_tokens
    # each expert runs on the filled slots of both ranks' buffers only: expert 3 on the 5 + 9 routes
    # (not 2 x capacity 9), rank 0's experts on none
    assert rows == ([0, 0] if rank == 0 else [0, 5 + 9]), rows
    torch.testing.assert_close(out, reference(x, skewed, weight), **TOL)
    assert (out.abs().sum(dim=1) > 0).all()

    # Capacity factor across EP: every rank uses the same capacity and drops as documented;
    # the kept routes then match the all-experts reference exactly.
    torch.manual_seed(1234)
    capped = TriRouteExperts(D_MODEL, D_EXPERT, NUM_EXPERTS, groups, capacity_factor=0.5, top_k=TOP_K)
    to_expert_0 = torch.zeros(9, TOP_K, dtype=torch.long)  # all routes to expert 0: the factor must bite
    xs = torch.randn(9, D_MODEL, generator=generator)
    ws = torch.rand(9, TOP_K, generator=generator)
    out = capped(xs, to_expert_0, ws)
    capacity = -(-9 * TOP_K // (2 * NUM_EXPERTS))  # ceil(0.5 * 9 * 2 / 4) = 3 on both ranks
    kept = torch.zeros(9, TOP_K, dtype=torch.bool)
    kept[:capacity, 0] = True  # column 0 fills the three slots in token order; column 1 is dropped
    torch.testing.assert_close(out, reference(xs, torch.where(kept, to_expert_0, -1), ws), **TOL)

    destroy_parallel()


@pytest.mark.distributed
def test_ep2_matches_ep1_outputs_and_gradients():
    run_distributed(_check_ep2_matches_ep1, 2)
