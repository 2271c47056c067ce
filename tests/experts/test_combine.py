"""The experts' combine (`experts/combine.py`): the C++ kernels against the tensor ops that define
them, the node's one call each way, rows no matmul computed never read. The Triton kernels are
checked under the interpreter (tests/kernels/interpret_cases.py)."""

import pytest
import torch
from triroute_kernels import cpu_ops_available

from megatron_triroute.experts.combine import CombineRoutes, combine_backward_torch, combine_kernels, combine_torch
from megatron_triroute.experts.routes import sort_routes
from tests.dispatched import DispatchedOps

E = 4


@pytest.fixture(scope="module", autouse=True)
def _built():
    assert cpu_ops_available(), "the C++ kernels did not build here"


def _case(k: int, D: int, seed: int = 0):
    """Routes with the null expert and a token whose routes are all null; NaN in the rows of the
    null routes (computed by no matmul)."""
    g = torch.Generator().manual_seed(seed + k * 10 + D)
    N = 11
    index = torch.randint(-1, E, (N, k), generator=g)
    index[3] = -1
    order, inverse, *_ = sort_routes(index, E)
    y = torch.randn(N * k, D, generator=g)
    y[(index < 0).view(-1)[order]] = float("nan")
    return y, order, inverse, index, torch.rand(N, k, generator=g), torch.randn(N, D, generator=g)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("D", [8, 13])
def test_cpu_kernels_give_the_definitions_values(k, D):
    """out and d y bit for bit, d weight within float32 rounding of the exact sums and 0 for a null
    route; nothing of a null route's row reaches a value."""
    y, order, inverse, index, weight, grad = _case(k, D)
    out = torch.ops.triroute.combine_routes(y, inverse, index, weight)
    assert torch.isfinite(out).all() and torch.equal(out, combine_torch(y, inverse, index, weight))
    assert torch.equal(out[3], torch.zeros(D))
    d_y, d_weight = torch.ops.triroute.combine_routes_backward(grad, y, order, inverse, index, weight)
    ref_y, ref_weight = combine_backward_torch(grad, y, order, inverse, index, weight)
    assert torch.equal(d_y, ref_y)
    rows = torch.where((index >= 0).view(-1, 1), y.index_select(0, inverse), 0).double()
    exact = (grad.double().repeat_interleave(k, 0) * rows).sum(-1).view(-1, k)
    torch.testing.assert_close(d_weight.double(), exact, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(d_weight, ref_weight, rtol=1e-5, atol=1e-5)
    assert torch.equal(d_weight[index < 0], torch.zeros(int((index < 0).sum())))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_cpu_kernel_without_weights_sums_each_tokens_routes(k):
    """Without weights (the gradient of the tokens' gather into expert order): each token's real
    routes' rows summed in order, bit for bit the definition's; NaN in the null routes' rows reaches
    nothing; a token whose routes are all null gets zeros."""
    y, order, inverse, index, _, _ = _case(k, 13)
    out = torch.ops.triroute.combine_routes(y, inverse, index, None)
    assert torch.isfinite(out).all() and torch.equal(out, combine_torch(y, inverse, index, None))
    assert torch.equal(out[3], torch.zeros(13))
    by_hand = torch.stack([sum((y[inverse[n * k + j]] for j in range(k) if index[n, j] >= 0), torch.zeros(13))
                           for n in range(index.shape[0])])
    torch.testing.assert_close(out, by_hand, rtol=1e-6, atol=1e-6)


def test_cpu_kernels_refuse_what_they_do_not_take():
    y, order, inverse, index, weight, grad = _case(2, 8)
    with pytest.raises(RuntimeError, match="must number N k"):
        torch.ops.triroute.combine_routes(y[:-1], inverse, index, weight)
    with pytest.raises(RuntimeError, match="is not a row of y"):
        torch.ops.triroute.combine_routes(y, torch.where(index.view(-1) >= 0, 10**6, inverse), index, weight)
    assert combine_kernels(y.double(), weight.double()) is None  # float64: the tensor ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_node_gives_autograds_gradients_in_one_call_each_way_where_a_kernel_runs(dtype):
    """float32: one kernel call forward and one backward, nothing beside them; float64 (no kernel):
    the tensor ops. Either way the gradients autograd computes through the definition."""
    y, order, inverse, index, weight, grad = (t.to(dtype) if t.is_floating_point() else t for t in _case(2, 16))
    y = torch.nan_to_num(y)  # autograd's gradient of the definition through a NaN row is NaN times 0
    leaves = [y.clone().requires_grad_(), weight.clone().requires_grad_()]
    ops = DispatchedOps()
    with ops:
        out = CombineRoutes.apply(leaves[0], order, inverse, index, leaves[1])
        got = torch.autograd.grad(out, leaves, grad)
    if dtype == torch.float32:
        assert ops.names == ["combine_routes", "combine_routes_backward"], ops.names
    else:
        assert "combine_routes" not in ops.names
    chain = [t.detach().clone().requires_grad_() for t in leaves]
    want = torch.autograd.grad(combine_torch(chain[0], inverse, index, chain[1]), chain, grad)
    d_y_routes = got[0][(index >= 0).view(-1)[order]]  # the rows of real routes (the others are never read)
    assert torch.equal(d_y_routes, want[0][(index >= 0).view(-1)[order]])
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)
