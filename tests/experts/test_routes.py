"""experts/routes.py: the routes sorted by expert, by hand."""

import torch

from megatron_triroute.experts import NULL_EXPERT
from megatron_triroute.experts.routes import sort_routes


def test_sort_routes_by_hand():
    index = torch.tensor([[1, NULL_EXPERT], [0, 1], [NULL_EXPERT, NULL_EXPERT]])
    order, inverse, offsets = sort_routes(index, 3)
    # routes (token-major) 1, -1, 0, 1, -1, -1: expert 0 first, then expert 1's two in order, null last
    assert order.tolist() == [2, 0, 3, 1, 4, 5]
    assert inverse.tolist() == [1, 3, 0, 2, 4, 5]
    assert offsets.tolist() == [1, 3, 3] and offsets.dtype == torch.int32  # expert 2 has no rows
