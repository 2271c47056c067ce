import torch

from benchmarks.op_counter import StepCounter
from megatron_triroute.routing.grad_balance import GradBalance
from megatron_triroute.routing.running_stats import commit_running_statistics, discard_running_statistics, ema_from_first
from megatron_triroute.routing.whitening import RunningWhitening


def _whitening_reference(mean, var, steps, acc, m):
    """Eq. whiten's EMA of one module from its reduced [count, sum(d), sum of squares(d)], float64."""
    d = mean.numel()
    count = acc[0].clamp_min(1.0)
    batch_mean = acc[1 : 1 + d] / count
    batch_var = (acc[1 + d :] / count - batch_mean.pow(2)).clamp_min(0.0)
    if acc[0] <= 0:
        return mean, var, steps
    return ((m * mean.double() + (1 - m) * batch_mean).float(), (m * var.double() + (1 - m) * batch_var).float(),
            steps + 1)


def _filled_modules(seed: int):
    """Whitening modules of different widths (one that saw no token) and gradient balances (one
    with no gradient), their statistics moved off their initial values and their accumulators filled."""
    g = torch.Generator().manual_seed(seed)
    whitening = [RunningWhitening(d, momentum=0.9) for d in (6, 3, 1, 4)]
    for i, w in enumerate(whitening):
        w.mean.copy_(torch.randn(w.mean.shape, generator=g))
        w.var.copy_(torch.rand(w.var.shape, generator=g) + 0.5)
        w.steps.fill_(i)
        tokens = torch.randn(0 if i == 2 else 5 + i, w.mean.numel(), generator=g, dtype=torch.float64)
        w._acc.copy_(torch.cat([torch.tensor([float(tokens.shape[0])], dtype=torch.float64),
                                tokens.sum(0), tokens.pow(2).sum(0)]))
    balances = [GradBalance(momentum=0.99) for _ in range(3)]
    for i, b in enumerate(balances):
        b.rho.fill_(1.0 + i)
        b._acc.fill_(0.0 if i == 1 else 3.0 * (i + 1))
    return whitening, balances


def test_batched_commit_equals_each_module_s_float64_update_bit_for_bit():
    whitening, balances = _filled_modules(0)
    expected_w = [_whitening_reference(w.mean.clone(), w.var.clone(), w.steps.clone(), w._acc.clone(), 0.9)
                  for w in whitening]
    expected_rho = [b.rho.clone() if b._acc[0] <= 0 else
                    (0.99 * b.rho.double() + 0.01 * b._acc[0].sqrt()).float() for b in balances]
    container = torch.nn.ModuleList([m for pair in zip(whitening, balances + [None]) for m in pair if m is not None])
    ops = StepCounter()
    with ops:
        commit_running_statistics([container])
    for w, (mean, var, steps) in zip(whitening, expected_w):
        assert torch.equal(w.mean, mean) and torch.equal(w.var, var) and torch.equal(w.steps, steps)
        assert not w._acc.any()
    for b, rho in zip(balances, expected_rho):
        assert torch.equal(b.rho, rho) and not b._acc.any()
    assert whitening[2].steps.item() == 2 and balances[1].rho.item() == 2.0  # nothing seen: kept
    # one batched update per kind of module, not a chain of ops per module (about 30 each before):
    # twice the modules dispatch no more ops
    twice = torch.nn.ModuleList([*_filled_modules(2)[0], *_filled_modules(3)[0], *_filled_modules(4)[1],
                                 *_filled_modules(5)[1]])
    ops_twice = StepCounter()
    with ops_twice:
        commit_running_statistics([twice])
    assert ops_twice.ops == ops.ops, (ops.ops, ops_twice.ops)


def test_discard_zeroes_every_accumulator_and_moves_no_statistic():
    whitening, balances = _filled_modules(1)
    container = torch.nn.ModuleList(whitening + balances)
    before = {k: v.clone() for k, v in container.state_dict().items()}
    discard_running_statistics([container])
    assert all(not m._acc.any() for m in container)
    assert all(torch.equal(v, before[k]) for k, v in container.state_dict().items())


def test_the_first_value_then_the_ema_by_hand_without_a_host_read():
    old = torch.tensor([0.25, 4.0], dtype=torch.float64)
    new = torch.tensor([1.0, -2.0], dtype=torch.float64)
    with StepCounter() as counter:
        first = ema_from_first(torch.zeros((), dtype=torch.long), old, new, 0.9)
        later = ema_from_first(torch.ones((), dtype=torch.long), old, new, 0.9)
    assert counter.syncs == {}
    assert first.tolist() == [1.0, -2.0]
    assert later.tolist() == [0.25 * 0.9 + 1.0 * (1 - 0.9), 4.0 * 0.9 + -2.0 * (1 - 0.9)]
