"""routing/counts.py: option counts without a host read, against torch.bincount."""

import pytest
import torch

from megatron_triroute.routing.counts import option_counts


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 2)])
def test_option_counts_equal_bincount(shape):
    g = torch.Generator().manual_seed(sum(shape))
    ids = torch.randint(0, 6, shape, generator=g)
    assert torch.equal(option_counts(ids, 9), torch.bincount(ids.reshape(-1), minlength=9))
    assert option_counts(ids, 9, torch.int32).dtype == torch.int32
    assert option_counts(ids, 9, torch.float32).sum().item() == ids.numel()


def test_option_counts_of_nothing_are_zeros():
    assert torch.equal(option_counts(torch.empty(0, dtype=torch.long), 3), torch.zeros(3, dtype=torch.long))
