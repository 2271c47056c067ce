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


def _eq_total_reference(out, cfg):
    """Eq. total's middle term as written: a zero, then per axis + alpha L_bal + beta L_z + gamma L_ent."""
    total = torch.zeros(())
    h_a = out.attn.logits.shape[2]
    for logits, executed in ((out.attn.logits, out.attn.y[:, :, :h_a].argmax(-1)),
                             (out.expert_logits, out.experts.option), (out.bits.logits, out.bits.y.argmax(-1))):
        f, p = axis_statistics(logits, executed)
        ent = entropy_floor_loss(p, cfg.entropy_floor) if cfg.use_entropy_floor else torch.zeros(())
        total = total + cfg.load_weight * switch_load_loss(f, p) + cfg.z_weight * router_z_loss(logits) \
            + cfg.entropy_weight * ent
    return total


def test_router_aux_loss_equals_eq_total_term_by_term_with_or_without_its_logged_terms():
    import dataclasses

    from megatron_triroute import TriRouteController
    from megatron_triroute.routing.losses import router_aux_loss
    from megatron_triroute.routing.noise import NoiseKey

    from .helpers import make_inputs, tiny_config

    cfg = tiny_config()
    torch.manual_seed(0)
    controller = TriRouteController(cfg, 0).train()
    hidden, side = make_inputs(cfg)
    out = controller(hidden * 3, side, NoiseKey(3, 0, 0, torch.arange(2), torch.arange(hidden.shape[1])), tau=1.0)
    for floor in (True, False):
        losses = dataclasses.replace(cfg.losses, use_entropy_floor=floor, entropy_floor=1.0, load_weight=0.3,
                                     z_weight=0.7, entropy_weight=1.3)
        expected = _eq_total_reference(out, losses)
        logged, terms = router_aux_loss(out, losses)
        bare, none = router_aux_loss(out, losses, with_terms=False)
        # every axis in one computation: the term functions' sum up to float32 rounding (the order
        # of the sums), the same bits whether the terms are logged or not
        torch.testing.assert_close(logged, expected, rtol=1e-6, atol=0)
        assert torch.equal(bare, logged) and not none
        assert len(terms) == 12 and (terms["experts/entropy_floor"] > 0) == floor
        grads = [torch.autograd.grad(t, controller.heads["experts"].proj.weight, retain_graph=True)[0]
                 for t in (bare, expected)]
        # the loss's own backward is its gradient written out: equal up to float32 rounding
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)
        assert grads[0].abs().sum() > 0


def test_balancing_loss_backward_equals_autograd_through_the_term_functions():
    """`_BalancingLoss`' written-out gradient against autograd through the term functions and Eq.
    total's weighted sum (both in float32 inside, as the terms are defined; float64 logits): floor
    active and not, an option whose mean probability is clamped (1e-12), top-k slots, several axes
    through one node; its logged terms equal the term functions up to float32 rounding."""
    import dataclasses

    from megatron_triroute.config import LossConfig
    from megatron_triroute.routing.losses import _BalancingLoss

    g = torch.Generator().manual_seed(4)
    cases = []
    logits = torch.randn(5, 7, 4, generator=g, dtype=torch.float64) * 2
    cases.append([(logits, torch.randint(0, 4, (5, 7), generator=g))])
    collapsed = logits.clone()
    collapsed[..., 2] = -80.0  # P_2 ~ 1e-35: below the clamp
    cases.append([(collapsed, torch.randint(0, 4, (5, 7), generator=g))])
    cases.append([(torch.randn(6, 9, 5, generator=g, dtype=torch.float64), torch.randint(0, 5, (6, 9, 2), generator=g)),
                  (logits, torch.randint(0, 4, (5, 7), generator=g))])  # top-2 slots, and two axes at once
    # axes of two shapes interleaved (each shape's axes stack into one group, the block in another
    # order than the axes'), two of them column slices of one tensor (as a layer's logits split are)
    wide = torch.randn(5, 7, 9, generator=g, dtype=torch.float64) * 3
    cases.append([(wide[..., :4], torch.randint(0, 4, (5, 7), generator=g)),
                  (torch.randn(6, 9, 5, generator=g, dtype=torch.float64), torch.randint(0, 5, (6, 9, 2), generator=g)),
                  (wide[..., 4:8], torch.randint(0, 4, (5, 7), generator=g)),
                  (torch.randn(6, 9, 5, generator=g, dtype=torch.float64) * 2, torch.randint(0, 5, (6, 9, 2), generator=g)),
                  (logits[:, :, :3], torch.randint(0, 3, (5, 7), generator=g))])
    base = LossConfig(load_weight=0.3, z_weight=0.7, entropy_weight=1.3)
    for axes in cases:
        for zeta, floor in ((2.0, True), (0.1, True), (2.0, False)):  # the floor active, inactive, off
            cfg = dataclasses.replace(base, entropy_floor=zeta, use_entropy_floor=floor)
            zs = [z.clone().requires_grad_(True) for z, _ in axes]
            mine, terms = _BalancingLoss.apply(cfg, True, tuple(ex for _, ex in axes), *zs)
            theirs = 0.0
            for z, (_, executed), row in zip(zs, axes, terms):
                f, p = axis_statistics(z, executed)
                ref = [switch_load_loss(f, p), router_z_loss(z),
                       entropy_floor_loss(p, zeta) if floor else torch.zeros(())]
                theirs = theirs + 0.3 * ref[0] + 0.7 * ref[1] + 1.3 * ref[2]
                torch.testing.assert_close(row.double(), torch.stack(ref + [marginal_entropy(p)]).double(),
                                           rtol=1e-6, atol=1e-7)  # float32 inside, summed in another order
                assert (row[2] > 0) == (floor and zeta > 1.0)
            torch.testing.assert_close(mine.double(), theirs.double(), rtol=1e-6, atol=0)
            # an upstream gradient other than 1 (the layer's loss scale reaches it so)
            for a, b in zip(torch.autograd.grad(2.5 * mine, zs), torch.autograd.grad(2.5 * theirs, zs)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9)
                assert a.abs().sum() > 0


def test_balancing_loss_gradient_keeps_float32_under_the_steps_bf16_autocast():
    """The trainer runs forward and backward inside one bf16 autocast context: the written-out
    backward must not drop to bf16 there (a matmul would)."""
    from megatron_triroute.config import LossConfig
    from megatron_triroute.routing.losses import _BalancingLoss

    g = torch.Generator().manual_seed(9)
    logits = torch.randn(64, 4, 6, generator=g)
    executed = torch.randint(0, 6, (64, 4), generator=g)
    cfg = LossConfig(load_weight=0.3, z_weight=0.7, entropy_weight=1.3, entropy_floor=1.0)
    grads = []
    for bf16 in (False, True):
        z = logits.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            _BalancingLoss.apply(cfg, False, (executed,), z)[0].backward()
        grads.append(z.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-6, atol=1e-9)
