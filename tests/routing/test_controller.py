import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from megatron_triroute import TriRouteController
from megatron_triroute.config import BudgetConfig
from megatron_triroute.routing.budget import BudgetController
from megatron_triroute.routing.grad_balance import GradBalance
from megatron_triroute.routing.noise import NoiseKey
from megatron_triroute.routing.running_stats import commit_running_statistics
from megatron_triroute.routing.whitening import RunningWhitening

from .helpers import make_inputs, tiny_config


def key_for(batch, T, sample_offset=0, step=0, layer=0):
    return NoiseKey(11, step, layer, torch.arange(sample_offset, sample_offset + batch), torch.arange(T))


def test_whitening_hand_computation_and_read_before_update():
    w = RunningWhitening(1, momentum=0.9).train()
    a = w(torch.tensor([[1.0], [3.0]]))
    b = w(torch.tensor([[5.0], [7.0]]))
    # Before the commit the forward uses mean 0, var 1: identity up to eps.
    assert torch.allclose(a, torch.tensor([[1.0], [3.0]]), atol=1e-4) and torch.allclose(b[:, 0], torch.tensor([5.0, 7.0]), atol=1e-4)
    commit_running_statistics([w])
    # Global batch {1,3,5,7}: mean 4, var (1+9+25+49)/4 - 16 = 5.
    assert torch.allclose(w.mean, torch.tensor([0.9 * 0 + 0.1 * 4]))
    assert torch.allclose(w.var, torch.tensor([0.9 * 1 + 0.1 * 5]))
    out = w.eval()(torch.tensor([[2.0]]))
    assert torch.allclose(out, torch.tensor([[(2.0 - 0.4) / (1.4**0.5 + 1e-5)]]))


def test_whitening_divisor_follows_every_write_of_its_statistics():
    """`RunningWhitening.standardisation` keeps the heads' stacked mean and std + eps between
    optimizer steps: a commit, a load, an in-place change and a replaced buffer are each seen at the
    next call; statistics made under inference mode (no version counter) are read afresh."""
    u = torch.randn(4, 5)

    def check(ws):
        mean, var = torch.cat([w.mean for w in ws]), torch.cat([w.var for w in ws])
        assert torch.equal(RunningWhitening.whiten_all(ws, u), (u - mean) / (var.sqrt() + 1e-5))

    ws = [RunningWhitening(2, momentum=0.5), RunningWhitening(3, momentum=0.5)]
    RunningWhitening.whiten_all([w.train() for w in ws], u)
    commit_running_statistics(ws)
    ws = [w.eval() for w in ws]
    check(ws)
    ws[1].var.fill_(4.0)
    check(ws)
    ws[0].load_state_dict({"mean": torch.ones(2), "var": torch.full((2,), 9.0), "steps": torch.tensor(3)})
    check(ws)
    ws[1].mean = torch.full((3,), 2.0)
    check(ws)
    with torch.inference_mode():
        fresh = [RunningWhitening(2).eval(), RunningWhitening(3).eval()]
        check(fresh)
        fresh[0].var.fill_(2.0)
        check(fresh)


def test_whitening_accumulates_once_under_activation_recompute_and_never_in_eval():
    w = RunningWhitening(3).train()
    x = torch.randn(5, 3, requires_grad=True)
    checkpoint(lambda t: w(t) * 2, x, use_reentrant=True).sum().backward()
    assert w.pending()[0].item() == 5  # the recompute inside backward did not count again
    checkpoint(lambda t: w(t) * 2, x, use_reentrant=False).sum().backward()
    assert w.pending()[0].item() == 10
    w.eval()(x)
    assert w.pending()[0].item() == 10


def test_grad_balance_identity_forward_and_scaled_backward():
    gb = GradBalance(momentum=0.99).train()
    z = torch.randn(4, 3, requires_grad=True)
    out = gb(z)
    assert torch.equal(out, z)
    up = torch.full((4, 3), 2.0)  # ||grad|| = sqrt(12 * 4) = sqrt(48)
    out.backward(up)
    assert torch.equal(z.grad, up)  # rho = 1 initially
    commit_running_statistics([gb])
    assert torch.allclose(gb.rho, torch.tensor(0.99 + 0.01 * 48**0.5))
    z.grad = None
    gb(z).backward(up)
    assert torch.allclose(z.grad, up / (0.99 + 0.01 * 48**0.5))


def test_grad_balance_leaves_controller_forward_bit_identical():
    on, off = tiny_config(grad_balance=True), tiny_config(grad_balance=False)
    torch.manual_seed(0)
    a = TriRouteController(on, 0).train()
    torch.manual_seed(0)
    b = TriRouteController(off, 0).train()
    hidden, side = make_inputs(on)
    oa = a(hidden, side, key_for(2, 12), tau=1.0)
    ob = b(hidden, side, key_for(2, 12), tau=1.0)
    assert torch.equal(oa.attn.y, ob.attn.y) and torch.equal(oa.bits.y, ob.bits.y)
    assert torch.equal(oa.experts.weight, ob.experts.weight)
    # After a balance update the gradient reaching the heads differs, the forward does not.
    (oa.attn.y * torch.randn_like(oa.attn.y)).sum().backward()
    commit_running_statistics([a])
    assert a.balance["attn"].rho.item() != 1.0
    oa2 = a(hidden, side, key_for(2, 12), tau=1.0)
    assert torch.equal(oa2.attn.y, oa.attn.y)


def test_decisions_do_not_depend_on_other_tokens_in_the_batch():
    cfg = tiny_config()
    torch.manual_seed(0)
    c = TriRouteController(cfg, 0).train()
    hidden, side = make_inputs(cfg, batch=3)
    # Warm the running statistics so whitening is not the identity.
    c(hidden * 3 + 1, side, key_for(3, 12))
    commit_running_statistics([c])
    both = c(hidden, side, key_for(3, 12, sample_offset=40))
    alone = c(hidden[1:2], side[1:2], key_for(1, 12, sample_offset=41))
    assert torch.equal(both.attn.y[1:2], alone.attn.y)
    assert torch.equal(both.bits.y[1:2], alone.bits.y)
    assert torch.equal(both.experts.index[1:2], alone.experts.index)
    assert torch.allclose(both.experts.weight[1:2], alone.experts.weight)


def test_eval_mode_executes_the_noise_free_argmax():
    cfg = tiny_config()
    c = TriRouteController(cfg, 0).eval()
    hidden, side = make_inputs(cfg)
    out = c(hidden, side, key_for(2, 12))
    assert torch.equal(out.attn.y.argmax(-1), out.attn.hard)
    assert torch.equal(out.bits.y.argmax(-1), out.bits.hard)
    assert torch.equal(out.attn.hard, out.attn.logits.argmax(-1))


def test_training_samples_follow_the_counter_noise():
    cfg = tiny_config()
    c = TriRouteController(cfg, 0).train()
    hidden, side = make_inputs(cfg)
    o1 = c(hidden, side, key_for(2, 12, step=0))
    o2 = c(hidden, side, key_for(2, 12, step=0))
    o3 = c(hidden, side, key_for(2, 12, step=1))
    assert torch.equal(o1.attn.y, o2.attn.y)
    assert not torch.equal(o1.attn.y, o3.attn.y)


def test_grad_balance_is_relative_to_the_layers_mean_norm():
    """After a commit, each axis's gradient is scaled by mean(rho) / rho_axis: axes with a large
    LM gradient are damped, small ones boosted, and the mean scale is preserved."""
    cfg = tiny_config()
    torch.manual_seed(0)
    c = TriRouteController(cfg, 0).train()
    rhos = {"attn": 4.0, "experts": 1.0, "bits": 0.25}
    for axis, rho in rhos.items():
        c.balance[axis].rho.fill_(rho)
    mean = sum(rhos.values()) / 3
    hidden, side = make_inputs(cfg)
    z = torch.randn(2, 12, 4, requires_grad=True)
    up = torch.ones(2, 12, 4)
    c.balance["bits"](z, c._balance_reference()).backward(up)
    assert torch.allclose(z.grad, up * mean / 0.25)
    z.grad = None
    c.balance["attn"](z, c._balance_reference()).backward(up)
    assert torch.allclose(z.grad, up * mean / 4.0)


class _HostReads(TorchDispatchMode):
    """Counts the aten ops that read a tensor's value on the host (a device sync on a GPU)."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten._local_scalar_dense, torch.ops.aten.is_nonzero):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_routing_path_reads_nothing_on_the_host_in_forward_backward_and_commit():
    cfg = tiny_config()
    controller = TriRouteController(cfg, 0).train()
    budget = BudgetController(BudgetConfig(flops_target=0.5, mem_target=0.4, dual_kp=0.5))
    hidden, side = make_inputs(cfg)
    B, T = hidden.shape[:2]
    reads = _HostReads()
    with reads:
        for step in range(2):  # the second step reads the budget's PI term after an update
            out = controller(hidden, side, key_for(B, T, step=step), tau=1.5)
            penalty = budget.penalty(torch.stack([out.attn.y_cost.sum(), out.bits.y_cost.sum()]) / (B * T))
            (out.attn.y.sum() + out.bits.y.sum() + out.experts.weight.sum() + penalty).backward()
            commit_running_statistics([controller])
            budget.update(torch.tensor([0.6, 0.5], dtype=torch.float64))
        controller.eval()(hidden, side)
    # Nothing per layer, per commit or in the budget's once-a-step update reads a value back.
    assert reads.reads == [], reads.reads


def test_commits_keep_the_statistics_when_nothing_was_seen_and_match_the_float64_formula():
    g = GradBalance(momentum=0.9)
    g.rho.fill_(2.0)
    g.commit(torch.zeros(1, dtype=torch.float64))
    assert g.rho.item() == 2.0
    g.commit(torch.tensor([9.0], dtype=torch.float64))
    assert g.rho.item() == torch.tensor(0.9 * 2.0 + 0.1 * 3.0, dtype=torch.float32).item()
    w = RunningWhitening(2, momentum=0.5)
    w.commit(torch.zeros(5, dtype=torch.float64))
    assert w.mean.tolist() == [0.0, 0.0] and w.var.tolist() == [1.0, 1.0] and w.steps.item() == 0


def heads_one_by_one(ctrl, hidden, side):
    """Each head called as its own module on the trunk's output (the reference of the stacked and
    folded head paths)."""
    h = ctrl.trunk(torch.cat([ctrl.input_norm(hidden.float()), side.float()], dim=-1))
    return {a: ctrl.heads[a](h) for a in ctrl.sizes}


def test_training_heads_run_together_equal_each_head_run_alone():
    """In training the heads are one matmul, one whitening pass and one gain and bias over their
    stacked parameters; logits, every gradient and every head's accumulated statistics equal the
    heads run one by one."""
    cfg = tiny_config()
    hidden, side = make_inputs(cfg)
    ctrls = [TriRouteController(cfg, 0).train() for _ in range(2)]
    ctrls[1].load_state_dict(ctrls[0].state_dict())
    for ctrl in ctrls:
        with torch.no_grad():
            for i, a in enumerate(ctrl.sizes):  # statistics, gain and bias away from their init
                g = torch.Generator().manual_seed(i)
                head = ctrl.heads[a]
                head.whiten.mean.copy_(torch.rand(head.whiten.mean.shape, generator=g) * 2 - 1)
                head.whiten.var.copy_(torch.rand(head.whiten.var.shape, generator=g) + 0.5)
                head.gain.copy_(torch.rand(head.gain.shape, generator=g) + 0.5)
                head.bias.copy_(torch.rand(head.bias.shape, generator=g) - 0.5)
    assert len(ctrls[0].sizes) == 3
    together = ctrls[0].logits(hidden, side)
    alone = heads_one_by_one(ctrls[1], hidden, side)
    upstream = {a: torch.randn(u.shape, generator=torch.Generator().manual_seed(7)) for a, u in alone.items()}
    for ctrl, out in ((ctrls[0], together), (ctrls[1], alone)):
        sum((out[a] * upstream[a]).sum() for a in ctrl.sizes).backward()
    for a in ctrls[0].sizes:
        torch.testing.assert_close(together[a], alone[a], rtol=1e-6, atol=1e-6)
        for (name, p0), p1 in zip(ctrls[0].heads[a].named_parameters(), ctrls[1].heads[a].parameters()):
            torch.testing.assert_close(p0.grad, p1.grad, rtol=1e-5, atol=1e-6, msg=f"{a}.{name}")
        torch.testing.assert_close(ctrls[0].heads[a].whiten.pending(), ctrls[1].heads[a].whiten.pending(),
                                   rtol=1e-5, atol=1e-6)  # sums of float32 logits that differ by rounding
    for (name, p0), p1 in zip(ctrls[0].trunk.named_parameters(), ctrls[1].trunk.parameters()):
        torch.testing.assert_close(p0.grad, p1.grad, rtol=1e-5, atol=1e-6, msg=f"trunk.{name}")
    assert ctrls[0].heads["attn"].whiten.pending()[0] == hidden.shape[0] * hidden.shape[1]


def test_evaluation_folds_the_heads_into_one_matmul_and_refolds_when_a_tensor_it_reads_changes():
    """Under no_grad in eval mode the heads (and their whitening) run as one cached affine map; it
    equals the heads run one by one, and follows an in-place change of a weight or a statistic."""
    cfg = tiny_config()
    ctrl = TriRouteController(cfg, 0).eval()
    hidden, side = make_inputs(cfg)
    for a in ctrl.sizes:  # statistics away from (0, 1), so that a missed whitening shows
        ctrl.heads[a].whiten.mean.uniform_(-1, 1)
        ctrl.heads[a].whiten.var.uniform_(0.5, 2)
        ctrl.heads[a].gain.data.uniform_(0.5, 2)

    def one_by_one():
        return {a: u.detach() for a, u in heads_one_by_one(ctrl, hidden, side).items()}

    with torch.no_grad():
        for change in (None, lambda h: h.proj.weight.add_(0.1), lambda h: h.whiten.mean.add_(0.5),
                       lambda h: h.whiten.var.mul_(2), lambda h: h.gain.mul_(-1), lambda h: h.bias.add_(1)):
            if change is not None:
                change(ctrl.heads["bits"])
            folded = ctrl.logits(hidden, side)
            assert ctrl._fold_key is not None
            for a, u in one_by_one().items():
                torch.testing.assert_close(folded[a], u, rtol=1e-5, atol=1e-5)


def test_undecided_evaluation_output_carries_the_logits_and_no_decision():
    """decide=False (the priced engine's path): the same logits as a deciding call, no decision on
    any routed axis (so a caller cannot act on an unpriced one), and refused while training."""
    cfg = tiny_config()
    ctrl = TriRouteController(cfg, 0).eval()
    hidden, side = make_inputs(cfg)
    with torch.no_grad():
        full = ctrl(hidden, side)
        raw = ctrl(hidden, side, decide=False)
    for axis in ("attn", "bits"):
        got, want = getattr(raw, axis), getattr(full, axis)
        assert got.y is None and got.hard is None and got.y_cost is None
        assert torch.equal(got.logits, want.logits)
    assert raw.experts is None and torch.equal(raw.expert_logits, full.expert_logits)
    ctrl.train()
    try:
        ctrl(hidden, side, decide=False)
    except ValueError as e:
        assert "decide=False is for evaluation" in str(e)
    else:
        raise AssertionError("decide=False ran in training mode")


def test_a_decode_steps_rows_take_the_fused_kernel_and_equal_the_modules():
    """Evaluation of at most DECODE_LINEAR_ROWS float32 rows on a CPU runs the input norm, the trunk
    and the folded heads as one call (`torch.ops.triroute.controller_logits`); the logits equal the
    modules run one by one (with and without whitening), follow an in-place change of a trunk
    weight or a head's statistic, and more rows, or a forward that can be differentiated, take the
    tensor ops."""
    from benchmarks.op_counter import StepCounter
    from triroute_kernels import cpu_ops_available
    from triroute_kernels.paged_ops import DECODE_LINEAR_ROWS

    assert cpu_ops_available(), "the C++ kernels did not build here"
    for whitening in (True, False):
        cfg = tiny_config(whitening=whitening)
        ctrl = TriRouteController(cfg, 0).eval()
        with torch.no_grad():
            for p in ctrl.parameters():  # gains, biases and norms away from their init
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.3)
            for a in ctrl.sizes if whitening else ():
                ctrl.heads[a].whiten.mean.uniform_(-1, 1)
                ctrl.heads[a].whiten.var.uniform_(0.5, 2)
        for rows in (1, 5, DECODE_LINEAR_ROWS, DECODE_LINEAR_ROWS + 1):
            hidden, side = make_inputs(cfg, batch=rows, seed=rows)
            hidden, side = hidden[:, :1] * 3, side[:, :1]  # one token per request, as a decode step
            changes = (None, lambda: ctrl.trunk.fc1.weight.add_(0.05), lambda: ctrl.trunk.norm.weight.mul_(-1),
                       lambda: ctrl.heads["experts"].bias.add_(1))
            if whitening:
                changes += (lambda: ctrl.heads["attn"].whiten.var.mul_(2),)
            for change in changes:
                with torch.no_grad():
                    if change is not None:
                        change()
                    with StepCounter() as counter:
                        got = ctrl.logits(hidden, side)
                    want = heads_one_by_one(ctrl, hidden, side)
                fused = counter.foreign_ops.get("triroute.controller_logits", 0)
                assert fused == (rows <= DECODE_LINEAR_ROWS), (rows, counter.foreign_ops)
                for a in ctrl.sizes:
                    torch.testing.assert_close(got[a], want[a], rtol=1e-5, atol=1e-5)
    with StepCounter() as counter:
        ctrl.logits(hidden[:1], side[:1])  # grad enabled: the modules (and their backward)
    assert "triroute.controller_logits" not in counter.foreign_ops


def test_the_fused_kernel_refuses_inputs_that_do_not_chain():
    from triroute_kernels import cpu_ops_available

    assert cpu_ops_available()
    x, side, g = torch.randn(2, 8), torch.randn(2, 3), torch.ones(8)
    w1, b1, w2, b2, gt = torch.randn(5, 11), torch.zeros(5), torch.randn(5, 5), torch.zeros(5), torch.ones(5)
    wh, bh = torch.randn(4, 5), torch.zeros(4)
    args = [x, side, g, 1e-6, w1, b1, w2, b2, gt, 1e-6, wh, bh]
    torch.library.opcheck(torch.ops.triroute.controller_logits, args)
    for i, bad in ((4, torch.randn(5, 10)), (0, x.double()), (10, torch.randn(4, 6)), (0, x.t())):
        with pytest.raises(RuntimeError, match="controller_logits"):
            torch.ops.triroute.controller_logits(*args[:i], bad, *args[i + 1:])
