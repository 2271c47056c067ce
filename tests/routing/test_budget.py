import math

import pytest
import torch

from megatron_triroute import BudgetController
from megatron_triroute.config import BudgetConfig, TriRouteConfig
from megatron_triroute.routing.cost import bit_costs
from megatron_triroute.routing.gumbel import st_gumbel_softmax, temperature_at
from megatron_triroute.routing.losses import router_z_loss

from tests.dist_utils import run_distributed


def test_dual_update_hand_computation():
    b = BudgetController(BudgetConfig(flops_target=0.5, mem_target=0.4, dual_step=0.05, ema_momentum=0.9, dual_kp=0.0))
    b.observe(torch.tensor([30.0, 10.0]), torch.tensor([50.0, 20.0]))  # micro-batch 1
    b.observe(torch.tensor([30.0, 10.0]), torch.tensor([50.0, 30.0]))  # micro-batch 2
    realised = b.step()
    assert torch.allclose(realised, torch.tensor([60 / 100, 20 / 50], dtype=torch.float64))
    # First step: EMA = realised; lambda = [0 + 0.05 (0.6 - 0.5)]_+, [0 + 0.05 (0.4 - 0.4)]_+.
    assert torch.allclose(b.lambdas, torch.tensor([0.005, 0.0], dtype=torch.float64))
    b.update(torch.tensor([0.2, 0.6]))
    ema = torch.tensor([0.9 * 0.6 + 0.1 * 0.2, 0.9 * 0.4 + 0.1 * 0.6], dtype=torch.float64)
    assert torch.allclose(b.ema, ema)
    assert torch.allclose(b.lambdas, torch.tensor([0.005 + 0.05 * (ema[0] - 0.5), 0.05 * (ema[1] - 0.4)], dtype=torch.float64))
    frac = torch.tensor([0.7, 0.5], requires_grad=True)
    pen = b.penalty(frac)
    assert math.isclose(pen.item(), b.lambdas[0].item() * 0.2 + b.lambdas[1].item() * 0.1, rel_tol=1e-6)


def test_a_budget_that_is_off_applies_and_reports_no_multiplier():
    # Spending above the targets would move an enabled budget's PI multipliers off zero.
    b = BudgetController(BudgetConfig(flops_target=0.5, mem_target=0.4, dual_kp=0.5, enabled=False))
    for _ in range(3):
        b.update(torch.tensor([0.9, 0.8]))
    assert torch.equal(b.multipliers(), torch.zeros(2, dtype=torch.float64))
    assert b.penalty(torch.tensor([0.9, 0.8])).item() == 0.0
    on = BudgetController(BudgetConfig(flops_target=0.5, mem_target=0.4, dual_kp=0.5))
    for _ in range(3):
        on.update(torch.tensor([0.9, 0.8]))
    assert (on.multipliers() > 0).all()


def test_tied_knob_uses_one_multiplier_on_the_summed_violation():
    b = BudgetController(BudgetConfig(flops_target=0.5, mem_target=0.5, tied=True, dual_kp=0.0))
    b.update(torch.tensor([0.7, 0.4]))
    assert b.lambdas.shape == (1,)
    assert math.isclose(b.lambdas.item(), 0.05 * (0.2 - 0.1), rel_tol=1e-6)
    assert math.isclose(b.penalty(torch.tensor([0.6, 0.6])).item(), b.lambdas.item() * 0.2, rel_tol=1e-6)


def test_pi_multipliers_hand_computation():
    """Applied multiplier = [lambda_I + k_P (EMA(C) - C*)]_+ ; lambda_I is the plain dual ascent."""
    b = BudgetController(BudgetConfig(flops_target=0.5, mem_target=0.4, dual_step=0.05, ema_momentum=0.9, dual_kp=0.5))
    assert torch.equal(b.multipliers(), b.lambdas)  # before the first update there is no error yet
    b.update(torch.tensor([0.6, 0.3]))
    assert torch.allclose(b.lambdas, torch.tensor([0.05 * 0.1, 0.0], dtype=torch.float64))
    assert torch.allclose(b.multipliers(), torch.tensor([0.005 + 0.5 * 0.1, 0.0], dtype=torch.float64))
    b.update(torch.tensor([0.5, 0.5]))
    ema = torch.tensor([0.9 * 0.6 + 0.1 * 0.5, 0.9 * 0.3 + 0.1 * 0.5], dtype=torch.float64)
    lam_i = (torch.tensor([0.005, 0.0], dtype=torch.float64) + 0.05 * (ema - torch.tensor([0.5, 0.4]))).clamp_min(0)
    assert torch.allclose(b.lambdas, lam_i)
    applied = (lam_i + 0.5 * (ema - torch.tensor([0.5, 0.4], dtype=torch.float64))).clamp_min(0)
    assert torch.allclose(b.multipliers(), applied)
    frac = torch.tensor([0.7, 0.5])
    assert math.isclose(b.penalty(frac).item(), applied[0].item() * 0.2 + applied[1].item() * 0.1, rel_tol=1e-6)


def test_multipliers_are_computed_once_until_a_buffer_they_read_changes():
    """Every layer reads the multipliers: the same tensor until the update, a load or a direct
    write of a buffer they read, then the new values (never a stale one)."""
    b = BudgetController(BudgetConfig(flops_target=0.5, mem_target=0.4, dual_step=0.05, dual_kp=0.5))
    b.update(torch.tensor([0.6, 0.3]))
    first = b.multipliers()
    assert b.multipliers() is first
    b.update(torch.tensor([0.7, 0.3]))
    second = b.multipliers()
    assert second is not first and not torch.equal(second, first)
    b.lambdas.fill_(0.25)  # any in-place write, e.g. a checkpoint load's copy_
    expected = (0.25 + 0.5 * (b.ema - b.targets)).clamp_min(0.0)
    assert torch.equal(b.multipliers(), expected)
    other = BudgetController(BudgetConfig(flops_target=0.5, mem_target=0.4, dual_kp=0.5))
    other.load_state_dict(b.state_dict())
    assert torch.equal(other.multipliers(), expected)


def test_inactive_constraint_decays_to_zero_and_stays_nonnegative():
    b = BudgetController(BudgetConfig(flops_target=0.9, mem_target=0.9, lambda_init=0.3))
    history = []
    for _ in range(200):
        b.update(torch.tensor([0.6, 0.5]))
        history.append(b.lambdas.clone())
    assert torch.all(torch.stack(history) >= 0)
    assert torch.equal(b.lambdas, torch.zeros(2, dtype=torch.float64))


def _relay_run(dual_kp: float, steps: int = 400) -> tuple[str, list[float]]:
    """The real controller driving a policy whose memory cost is a step function of the applied
    multiplier: 0.5 below 0.2, 0.3 at or above it, around a 0.4 target (the argmax policy of tokens
    with equal margins). Returns the cost pattern ('a' = 0.5, 'b' = 0.3) and the memory EMA, per step."""
    budget = BudgetController(BudgetConfig(flops_target=1.0, mem_target=0.4, dual_kp=dual_kp))
    pattern, ema = "", []
    for _ in range(steps):
        high = budget.multipliers()[1].item() < 0.2
        budget.update(torch.tensor([0.5, 0.5 if high else 0.3], dtype=torch.float64))
        pattern += "a" if high else "b"
        ema.append(budget.ema[1].item())
    return pattern, ema


def test_pi_damping_shrinks_the_limit_cycle_of_a_step_function_cost():
    """Plain dual ascent (k_P = 0) on a relay settles into a limit cycle: the multiplier follows
    the sign of the EMA, which lags the policy's switch, so the policy spends 4 steps on each side
    (period 8). With the default k_P the applied multiplier turns as soon as the EMA does, and the
    policy alternates every step (period 2). By hand: a square wave of +-d around the target with
    K steps per side drives an EMA of momentum m between target +- d (1 - m^K) / (1 + m^K), so the
    EMA's peak-to-peak is 2 d (1 - m^K) / (1 + m^K): 0.0415 at K = 4 against 0.0105 at K = 1 (d = 0.1,
    m = 0.9), 3.9 times smaller. The last half of 400 steps is compared."""
    assert BudgetConfig().dual_kp == 0.5 and BudgetConfig().ema_momentum == 0.9
    d, m = 0.1, 0.9
    swing = {}
    for kp, period in ((0.0, "aaaabbbb"), (BudgetConfig().dual_kp, "ab")):
        pattern, ema = _relay_run(kp)
        tail = pattern[200:]
        n = len(period)  # the last half repeats one rotation of `period`
        assert tail[:n] in period * 2 and tail == (tail[:n] * len(tail))[:len(tail)], (kp, tail[-40:])
        k = n // 2
        swing[kp] = max(ema[200:]) - min(ema[200:])
        assert math.isclose(swing[kp], 2 * d * (1 - m**k) / (1 + m**k), rel_tol=1e-3), (kp, swing[kp])
        assert abs(sum(ema[200:]) / 200 - 0.4) <= 0.01  # both centre on the target
    assert swing[0.5] <= swing[0.0] / 3, swing


def _bits_policy_run(target: float, steps: int = 1000) -> list[float]:
    """Per-token bit-width policies of heterogeneous value, priced by the real budget loop.

    Quality prefers more bits, more so for high-value tokens; the memory multiplier must pull
    the noise-free argmax policy to the target. The policy is tabular (one logit vector per
    token) so the test exercises the dual dynamics, not a network's capacity.
    """
    cfg = TriRouteConfig()
    cfg.model.d_model, cfg.model.n_heads, cfg.model.n_kv_heads = 128, 4, 2  # d_kv = 64
    cfg.router.kv_group_size = 32
    torch.manual_seed(0)
    per_token = (bit_costs(cfg.router, cfg.model) / (2 * cfg.model.d_kv * 16)).float()  # fraction per option
    n = 512
    value = torch.linspace(0.05, 1.0, n).unsqueeze(-1)
    quality = 4.0 * torch.tensor([0.0, 0.55, 0.85, 1.0])
    logits = torch.zeros(n, 4, requires_grad=True)
    opt = torch.optim.Adam([logits], lr=0.05)
    budget = BudgetController(BudgetConfig(flops_target=1.0, mem_target=target))
    realised = []
    for step in range(steps):
        y = st_gumbel_softmax(logits, tau=temperature_at(step, steps))
        mem = (y * per_token).sum(-1).mean()
        loss = -(value * y * quality).sum(-1).mean() + budget.penalty(torch.stack([mem.new_tensor(0.5), mem]))
        loss = loss + 1e-2 * router_z_loss(logits)
        opt.zero_grad()
        loss.backward()
        opt.step()
        hard = per_token[logits.detach().argmax(-1)].double()  # judged on noise-free decisions
        budget.observe(torch.tensor([0.5 * n, hard.sum().item()], dtype=torch.float64),
                       torch.tensor([float(n), float(n)], dtype=torch.float64))
        realised.append(budget.step()[1].item())
    return realised


@pytest.mark.parametrize("target", [0.45, 0.6, 0.7, 0.85])
def test_active_constraint_converges_to_target(target):
    realised = _bits_policy_run(target)
    assert max(realised[:300]) > target + 0.05  # the constraint binds: unpriced, the policy overshoots
    tail = realised[-200:]
    assert abs(sum(tail) / len(tail) - target) <= 0.02, (target, sum(tail) / len(tail))
    assert max(abs(r - target) for r in tail[-20:]) <= 0.02


def _dp_worker(rank, world_size):
    import torch.distributed as dist

    from megatron_triroute import BudgetController
    from megatron_triroute.config import BudgetConfig

    torch.manual_seed(100)
    steps = [(torch.rand(6, 2, dtype=torch.float64) * 50 + 40, torch.rand(6, 2, dtype=torch.float64) * 20 + 80) for _ in range(5)]
    local = BudgetController(BudgetConfig())
    union = BudgetController(BudgetConfig())
    for cost, dense in steps:
        # Each rank sees different micro-batches of the global batch: rows rank::2.
        for i in range(rank, 6, world_size):
            local.observe(cost[i], dense[i])
        local.step(lambda t: dist.all_reduce(t))
        for i in range(6):
            union.observe(cost[i], dense[i])
        union.step()
    gathered = [torch.zeros(2, dtype=torch.float64) for _ in range(world_size)]
    dist.all_gather(gathered, local.lambdas)
    assert torch.equal(gathered[0], gathered[1]), gathered  # bit-identical on both ranks
    assert torch.allclose(local.lambdas, union.lambdas, atol=1e-6, rtol=0)
    assert local.lambdas.sum() > 0  # the constraint was active, so equality is not trivial


@pytest.mark.distributed
def test_two_ranks_agree_bitwise_and_match_one_process_on_the_union():
    run_distributed(_dp_worker, 2)


def test_the_dual_update_reads_nothing_back_to_the_host():
    """`update` selects the first step's EMA on the device: no host read (a device wait on a GPU)
    in any step, and the EMA is the hand computation's."""
    from benchmarks.op_counter import StepCounter

    b = BudgetController(BudgetConfig(flops_target=0.5, mem_target=0.4, dual_step=0.05, ema_momentum=0.9, dual_kp=0.0))
    counter = StepCounter()
    with counter:
        b.update(torch.tensor([0.6, 0.4], dtype=torch.float64))
        first = b.ema.clone()
        b.update(torch.tensor([0.2, 0.6], dtype=torch.float64))
    assert counter.host_syncs == 0, counter.syncs
    assert first.tolist() == [0.6, 0.4]  # the first step: the realised fractions themselves
    ema = torch.tensor([0.9 * 0.6 + 0.1 * 0.2, 0.9 * 0.4 + 0.1 * 0.6], dtype=torch.float64)
    torch.testing.assert_close(b.ema, ema, rtol=1e-14, atol=0.0)
    assert int(b.steps) == 2
