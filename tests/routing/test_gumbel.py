import math

import pytest
import torch
import torch.nn.functional as F

from megatron_triroute import st_gumbel_softmax
from megatron_triroute.routing.gumbel import (
    soft_gumbel_sample,
    straight_through,
    straight_through_pair,
    temperature_at,
)
from megatron_triroute.routing.grad_balance import GradBalance
from megatron_triroute.routing.noise import NoiseKey, uniform_from_keys


def test_forward_is_exactly_one_hot():
    logits = torch.randn(64, 5)
    y = st_gumbel_softmax(logits, tau=0.7)
    assert torch.equal(y.sum(-1), torch.ones(64))
    assert set(y.unique().tolist()) <= {0.0, 1.0}


def test_straight_through_gradient_equals_soft_sample_gradient():
    logits = torch.randn(8, 4, dtype=torch.float64, requires_grad=True)
    noise = -torch.log(-torch.log(torch.rand(8, 4, dtype=torch.float64)))
    w = torch.randn(8, 4, dtype=torch.float64)
    (g_st,) = torch.autograd.grad((w * st_gumbel_softmax(logits, 0.9, noise=noise)).sum(), logits)
    (g_soft,) = torch.autograd.grad((w * soft_gumbel_sample(logits, noise, 0.9)).sum(), logits)
    assert torch.equal(g_st, g_soft)
    assert g_st.abs().sum() > 0


def test_straight_through_pair_equals_each_view_alone_bit_for_bit():
    """One node for both views (model path through gradient balancing, budget path from the raw
    logits): forward values and each view's gradient equal two separate straight-through samples,
    bit for bit, with the temperature a float or a 0-d tensor, and with one view unused."""
    torch.manual_seed(3)
    z0 = torch.randn(6, 5, 3, 4)
    noise = -torch.log(-torch.log(torch.rand(6, 5, 3, 4)))
    w_model, w_cost = torch.randn(6, 5, 3, 4), torch.randn(6, 5, 3, 4)
    balance = GradBalance(momentum=0.9).train()
    balance.rho.fill_(2.5)
    for tau in (0.7, torch.tensor(0.7)):
        for use_cost in (True, False):
            grads = []
            for pair in (True, False):
                z = z0.clone().requires_grad_(True)
                z_model = balance(z, torch.tensor(1.0))
                if pair:
                    y, y_cost = straight_through_pair(z_model, z, noise, tau)
                else:
                    y = straight_through(soft_gumbel_sample(z_model, noise, tau))
                    y_cost = straight_through(soft_gumbel_sample(z, noise, tau))
                loss = (w_model * y).sum() + ((w_cost * y_cost).sum() if use_cost else 0)
                loss.backward()
                grads.append((y.detach(), y_cost.detach(), z.grad))
            (y_a, c_a, g_a), (y_b, c_b, g_b) = grads
            assert torch.equal(y_a, y_b) and torch.equal(c_a, c_b) and torch.equal(g_a, g_b), (tau, use_cost)
            assert set(y_a.unique().tolist()) == {0.0, 1.0} and g_a.abs().sum() > 0


def test_argmax_frequencies_match_softmax_chi_square():
    logits = torch.tensor([1.0, 0.0, -0.5, 0.7])
    n = 20000
    key = NoiseKey(seed=7, step=3, layer=1, sample_index=torch.arange(n), positions=torch.arange(1))
    noise = key.gumbel((n, 1, 4), axis=0).view(n, 4)
    counts = torch.bincount(st_gumbel_softmax(logits.expand(n, 4), noise=noise).argmax(-1), minlength=4).double()
    expected = F.softmax(logits.double(), -1) * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    # 99.9% quantile of chi-square with 3 degrees of freedom is 16.27.
    assert chi2 < 16.27, (counts, expected)


def test_small_temperature_gives_near_one_hot_soft_samples():
    logits = torch.randn(256, 4)
    soft = st_gumbel_softmax(logits, tau=1e-3, hard=False)
    assert (soft.max(-1).values > 0.99).float().mean() > 0.97
    warm = st_gumbel_softmax(logits, tau=5.0, hard=False)
    assert warm.max(-1).values.mean() < 0.6


def test_noise_depends_on_token_identity_not_layout():
    B, T, H, M = 4, 10, 3, 3
    full = NoiseKey(1, 5, 2, torch.arange(100, 100 + B), torch.arange(T)).gumbel((B, T, H, M), axis=0)
    # The same tokens split over two data-parallel ranks and two sequence shards.
    part = NoiseKey(1, 5, 2, torch.tensor([102, 103]), torch.arange(5, 10)).gumbel((2, 5, H, M), axis=0)
    assert torch.equal(full[2:, 5:], part)
    # Any key field changes the noise.
    for changed in (NoiseKey(2, 5, 2, torch.arange(100, 104), torch.arange(T)),
                    NoiseKey(1, 6, 2, torch.arange(100, 104), torch.arange(T)),
                    NoiseKey(1, 5, 3, torch.arange(100, 104), torch.arange(T))):
        assert not torch.equal(changed.gumbel((B, T, H, M), axis=0), full)
    assert not torch.equal(NoiseKey(1, 5, 2, torch.arange(100, 104), torch.arange(T)).gumbel((B, T, H, M), axis=1), full)


def test_counter_uniforms_are_uniform():
    u = uniform_from_keys(3, torch.arange(50000))
    assert 0.0 < u.min() and u.max() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.01
    assert abs(u.var().item() - 1 / 12) < 0.003
    assert u.unique().numel() > 49000


def test_temperature_schedule_cosine_2_to_half():
    assert temperature_at(0, 100) == 2.0
    assert math.isclose(temperature_at(50, 100), 1.25)  # midpoint of a cosine = mean of the ends
    assert math.isclose(temperature_at(100, 100), 0.5)
    assert math.isclose(temperature_at(500, 100), 0.5)
    assert math.isclose(temperature_at(25, 100), 0.5 + 0.75 * (1 + math.cos(math.pi / 4)))


@pytest.mark.parametrize("shape", [(64, 5, 3, 4), (200, 3), (80, 7)])
def test_straight_through_pair_kernels_give_the_definitions_bits(shape):
    """Float32 CPU rows of a few options, the temperature a Python number: the pair runs as one
    `st_gumbel` call forward and one `st_gumbel_backward` call backward, and gives the values and
    both views' gradients of two separate straight-through samples bit for bit; a row with tied
    maxima takes the first, as `argmax` does."""
    from triroute_kernels import cpu_ops_available

    from tests.dispatched import DispatchedOps

    assert cpu_ops_available(), "the C++ kernels did not build here"

    g = torch.Generator().manual_seed(len(shape))
    z0 = torch.randn(*shape, generator=g) * 3
    noise = -torch.log(-torch.log(torch.rand(*shape, generator=g)))
    z0.view(-1, shape[-1])[0] = 1.0
    noise.view(-1, shape[-1])[0] = 0.0  # a tie across every option: the first wins
    w_model, w_cost = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
    results = []
    for pair in (True, False):
        z = z0.clone().requires_grad_(True)
        z_model = z * 1.0  # a gradient-only stand-in for the balance (one more node on the model path)
        with DispatchedOps() as ops:
            if pair:
                y, y_cost = straight_through_pair(z_model, z, noise, 0.7)
            else:
                y = straight_through(soft_gumbel_sample(z_model, noise, 0.7))
                y_cost = straight_through(soft_gumbel_sample(z, noise, 0.7))
            d_z, = torch.autograd.grad((w_model * y).sum() + (w_cost * y_cost).sum(), [z])
        results.append((y, y_cost, d_z, ops.names))
    (y_a, c_a, d_a, ops), (y_b, c_b, d_b, _) = results
    assert ops.count("st_gumbel") == 1 and ops.count("st_gumbel_backward") == 1, ops
    assert not {"few_softmax", "_softmax_backward_data", "scatter_"} & set(ops), ops
    assert torch.equal(y_a, y_b) and torch.equal(c_a, c_b) and torch.equal(d_a, d_b)
    assert y_a.view(-1, shape[-1])[0].tolist() == [1.0] + [0.0] * (shape[-1] - 1)
    assert d_a.abs().sum() > 0


def test_straight_through_pair_keeps_the_tensor_ops_where_the_kernels_would_differ():
    """Eight options or more (PyTorch's softmax backward then sums a row in a tree), fewer than
    `softmax.MANY` elements (the definition's softmax is then `F.softmax`), a temperature tensor, a
    noise that broadcasts: no kernel."""
    from megatron_triroute.routing.gumbel import st_kernels

    assert st_kernels(torch.randn(80, 7), torch.randn(80, 7), 0.7) is not None
    assert st_kernels(torch.randn(80, 8), torch.randn(80, 8), 0.7) is None
    assert st_kernels(torch.randn(10, 4), torch.randn(10, 4), 0.7) is None
    assert st_kernels(torch.randn(200, 4), torch.randn(200, 4), torch.tensor(0.7)) is None
    assert st_kernels(torch.randn(200, 4), torch.randn(1, 4), 0.7) is None  # a broadcast noise
