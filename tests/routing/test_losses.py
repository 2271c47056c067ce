import math

import torch

from megatron_triroute.routing.losses import (
    axis_statistics, entropy_floor_loss, marginal_entropy, router_z_loss, switch_load_loss,
)


def test_switch_load_loss_hand_value():
    f = torch.tensor([0.5, 0.5, 0.0])
    p = torch.tensor([0.4, 0.4, 0.2])
    assert math.isclose(switch_load_loss(f, p).item(), 3 * (0.5 * 0.4 + 0.5 * 0.4), rel_tol=1e-6)


def test_switch_load_loss_gradient_only_through_probabilities():
    f = torch.tensor([0.25, 0.75], requires_grad=True)
    p = torch.tensor([0.5, 0.5], requires_grad=True)
    switch_load_loss(f, p).backward()
    assert f.grad is None or torch.all(f.grad == 0)
    assert torch.allclose(p.grad, 2 * torch.tensor([0.25, 0.75]))


def test_z_loss_hand_value():
    # logsumexp([0, ln 3]) = ln 4; logsumexp([0, 0]) = ln 2.
    z = torch.tensor([[0.0, math.log(3.0)], [0.0, 0.0]])
    assert math.isclose(router_z_loss(z).item(), (math.log(4) ** 2 + math.log(2) ** 2) / 2, rel_tol=1e-6)


def test_entropy_floor_hinge():
    # Uniform over 2 of 4 options: H = ln 2 = 0.5 * ln 4 -> exactly at the floor -> 0.
    assert entropy_floor_loss(torch.tensor([0.5, 0.5, 0.0, 0.0]), 0.5).item() < 1e-6
    # Collapsed: H = 0 -> zeta * ln 4.
    collapsed = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert math.isclose(entropy_floor_loss(collapsed, 0.5).item(), 0.5 * math.log(4), rel_tol=1e-5)
    # Healthy: inactive.
    assert entropy_floor_loss(torch.full((4,), 0.25), 0.5).item() == 0.0
    assert math.isclose(marginal_entropy(torch.full((4,), 0.25)).item(), math.log(4), rel_tol=1e-6)


def test_axis_statistics_counts_top_k_slots():
    logits = torch.zeros(2, 3)
    executed = torch.tensor([[0, 1], [0, 2]])
    f, p = axis_statistics(logits, executed)
    assert torch.allclose(f, torch.tensor([0.5, 0.25, 0.25]))
    assert torch.allclose(p, torch.full((3,), 1 / 3))
