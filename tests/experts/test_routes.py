"""experts/routes.py: the routes sorted by expert, by hand and against the definition."""

import pytest
import torch

from megatron_triroute.experts import NULL_EXPERT
from megatron_triroute.experts.routes import sort_routes, sort_routes_torch
from tests.dispatched import DispatchedOps
from triroute_kernels import cpu_ops_available


@pytest.mark.parametrize("sort", [sort_routes, sort_routes_torch])
def test_sort_routes_by_hand(sort):
    index = torch.tensor([[1, NULL_EXPERT], [0, 1], [NULL_EXPERT, NULL_EXPERT]])
    order, inverse, offsets, token = sort(index, 3)
    # routes (token-major) 1, -1, 0, 1, -1, -1: expert 0 first, then expert 1's two in order, null last
    assert order.tolist() == [2, 0, 3, 1, 4, 5]
    assert inverse.tolist() == [1, 3, 0, 2, 4, 5]
    assert offsets.tolist() == [1, 3, 3] and offsets.dtype == torch.int32  # expert 2 has no rows
    assert token.tolist() == [1, 0, 1, 0, 2, 2]  # order // k


@pytest.mark.skipif(not cpu_ops_available(), reason="the C++ kernels are not built here")
@pytest.mark.parametrize("shape, experts", [((500, 2), 8), ((37, 1), 3), ((9, 4), 1), ((0, 2), 4)])
def test_the_kernel_sorts_as_the_definition_in_one_call(shape, experts):
    """The counting sort's four tensors equal the stable argsort's exactly (every expert, one with no
    route, null routes, no route at all), one dispatched op; an expert id past the last is an error
    naming the fix."""
    g = torch.Generator().manual_seed(shape[0])
    index = torch.randint(-1, experts, shape, generator=g)
    with DispatchedOps() as ops:
        got = sort_routes(index, experts)
    assert ops.names == ["sort_routes"]
    for a, b in zip(got, sort_routes_torch(index, experts)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    if index.numel():
        bad = index.clone()
        bad[0, 0] = experts + 1  # (experts itself is the null key, as the definition keys it)
        with pytest.raises(RuntimeError, match="expert ids lie in"):
            sort_routes(bad, experts)
