"""A layer's axes balanced through one node (`GradBalance.balance_all`): each axis's gradient
divided by its own rho / reference and its squared norm added to its own accumulator, as one module
at a time does; an axis that takes no gradient adds nothing."""

import torch

from megatron_triroute.routing.grad_balance import GradBalance


def _modules(rhos):
    modules = [GradBalance(momentum=0.9).train() for _ in rhos]
    for m, r in zip(modules, rhos):
        m.rho.fill_(r)
    return modules


def test_every_axis_in_one_node_equals_each_module_on_its_own():
    g = torch.Generator().manual_seed(0)
    shapes = [(2, 3, 4, 3), (2, 3, 5), (2, 3, 4)]
    rhos = [0.5, 2.0, 1.25]
    upstream = [torch.randn(s, generator=g) for s in shapes]
    zs = [torch.randn(s, generator=g, requires_grad=True) for s in shapes]
    joint = _modules(rhos)
    reference = torch.stack([m.rho for m in joint]).mean()
    outs = GradBalance.balance_all(joint, zs, reference)
    for z, out in zip(zs, outs):
        assert torch.equal(out, z)  # the identity forward
    sum((u * o).sum() for u, o in zip(upstream, outs)).backward()
    got = [z.grad.clone() for z in zs]

    alone = _modules(rhos)
    for m, z, u in zip(alone, zs, upstream):
        z.grad = None
        (u * m(z, reference)).sum().backward()
    for i, (m_joint, m_alone, z) in enumerate(zip(joint, alone, zs)):
        assert torch.equal(got[i], z.grad), i  # the same division, bit for bit
        torch.testing.assert_close(got[i], upstream[i] * reference / rhos[i], rtol=1e-6, atol=0)
        want = upstream[i].double().pow(2).sum()
        torch.testing.assert_close(m_joint.pending(), want.view(1), rtol=1e-12, atol=0)
        torch.testing.assert_close(m_alone.pending(), want.view(1), rtol=1e-12, atol=0)


def test_an_axis_without_gradient_adds_nothing():
    modules = _modules([1.0, 3.0])
    zs = [torch.randn(4, 3, requires_grad=True), torch.randn(4, 2, requires_grad=True)]
    outs = GradBalance.balance_all(modules, zs, torch.tensor(2.0))
    (outs[1] * 2.0).sum().backward()  # the first axis's output unused
    assert zs[0].grad is None and float(modules[0].pending()) == 0.0
    torch.testing.assert_close(zs[1].grad, torch.full((4, 2), 2.0 * 2.0 / 3.0))
    torch.testing.assert_close(modules[1].pending(), torch.tensor([4.0 * 8], dtype=torch.float64))
