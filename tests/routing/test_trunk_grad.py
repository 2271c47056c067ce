import pytest
import torch

from benchmarks.op_counter import StepCounter
from megatron_triroute import TriRouteController
from megatron_triroute.routing.trunk_grad import _rms_norm, _rms_norm_backward, _rms_norm_torch_backward
from triroute_kernels import cpu_ops_available

from .helpers import make_inputs, tiny_config


def autograd_logits(ctrl, hidden, side):
    """The controller's modules run one by one under autograd (the definition)."""
    h = ctrl.trunk(torch.cat([ctrl.input_norm(hidden), side], dim=-1))
    return {a: ctrl.heads[a](h) for a in ctrl.sizes}


def _moved(ctrl, whitening: bool) -> None:
    """Parameters and statistics away from their init, so that a missed term shows."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in ctrl.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
        for a in ctrl.sizes if whitening else ():
            ctrl.heads[a].whiten.mean.copy_(torch.rand(ctrl.heads[a].whiten.mean.shape, generator=g) * 2 - 1)
            ctrl.heads[a].whiten.var.copy_(torch.rand(ctrl.heads[a].whiten.var.shape, generator=g) + 0.5)


@pytest.mark.parametrize("whitening", [True, False])
def test_training_logits_and_every_gradient_equal_autograd_through_the_modules(whitening):
    """The training logits (one hand-derived backward for norm, trunk, heads, whitening, gain and
    bias) equal the modules run one by one under autograd within float32 rounding: the logits (every
    head's projection is one matmul over the stacked heads, which a BLAS may block otherwise than
    one head's: not bit for bit on every CPU), and the gradients of the hidden state, of psi and of
    every controller parameter; the whitening statistics accumulate once either way (their sums of
    the logits' projections within the same rounding)."""
    cfg = tiny_config(whitening=whitening)
    hidden, side = make_inputs(cfg, batch=3)
    ctrls = [TriRouteController(cfg, 0).train() for _ in range(2)]
    _moved(ctrls[0], whitening)
    ctrls[1].load_state_dict(ctrls[0].state_dict())
    inputs = [(hidden.clone().requires_grad_(), side.clone().requires_grad_()) for _ in ctrls]
    fast = ctrls[0].logits(*inputs[0])
    ref = autograd_logits(ctrls[1], *inputs[1])
    g = torch.Generator().manual_seed(5)
    upstream = {a: torch.randn(u.shape, generator=g) for a, u in ref.items()}
    for out in (fast, ref):
        sum((out[a] * upstream[a]).sum() for a in out).backward()
    for a in ref:
        torch.testing.assert_close(fast[a], ref[a], rtol=1e-6, atol=1e-6 * float(ref[a].abs().max()), msg=a)
    for (x0, x1), name in zip(zip(*inputs), ("hidden", "side")):
        torch.testing.assert_close(x0.grad, x1.grad, rtol=1e-5, atol=1e-6 * float(x1.grad.abs().max()), msg=name)
        assert x0.grad.abs().max() > 1e-3  # the gradient reached it
    for (name, p0), p1 in zip(ctrls[0].named_parameters(), ctrls[1].parameters()):
        if p1.grad is None:  # the gradient-balance statistics hold no parameter; nothing else may be missing
            assert p0.grad is None, name
            continue
        torch.testing.assert_close(p0.grad, p1.grad, rtol=1e-5, atol=1e-6 * float(p1.grad.abs().max()), msg=name)
        assert p0.grad.abs().max() > 0, name
    if whitening:
        for a in ref:
            # [count, sums, squares] of u: the counts exactly, the sums within the logits' float32 rounding
            fast_acc, ref_acc = ctrls[0].heads[a].whiten.pending(), ctrls[1].heads[a].whiten.pending()
            assert fast_acc[0] == ref_acc[0], a
            torch.testing.assert_close(fast_acc, ref_acc, rtol=1e-6, atol=1e-6 * float(ref_acc.abs().max()), msg=a)
            assert fast_acc[0] == hidden.shape[0] * hidden.shape[1]


def test_rms_norm_backward_equals_autograd_and_a_hand_computation():
    x = torch.tensor([[3.0, 4.0]], requires_grad=True)
    w = torch.tensor([2.0, 0.5], requires_grad=True)
    y, rstd = _rms_norm(x, w, 0.0)
    assert torch.allclose(rstd, torch.tensor([[1 / 12.5**0.5]]))  # mean(9, 16) = 12.5
    dy = torch.tensor([[1.0, -1.0]])
    y.backward(dy)
    dx, dw = _rms_norm_backward(dy, x.detach(), rstd.detach(), w.detach())
    torch.testing.assert_close(dx, x.grad)
    torch.testing.assert_close(dw, w.grad)
    for a, b in zip(_rms_norm_torch_backward(dy, x.detach(), rstd.detach(), w.detach()), (dx, dw)):
        torch.testing.assert_close(a, b)
    x_hat = torch.tensor([3.0, 4.0]) / 12.5**0.5
    torch.testing.assert_close(dw, (dy * x_hat)[0])  # d/dw of w * x_hat
    # y is invariant to scaling x, so dx is orthogonal to x
    assert abs(float((dx * x.detach()).sum())) < 1e-5


@pytest.mark.skipif(not cpu_ops_available(), reason="the C++ kernels did not build here")
def test_the_cpu_kernels_equal_the_tensor_ops_and_autograd():
    """`triroute.rms_norm_rstd` and `triroute.rms_norm_backward` (what `_rms_norm` and
    `_rms_norm_backward` call on a CPU) against PyTorch's op and the formula as tensor ops, and
    against autograd through `F.rms_norm`: rows of both controller widths, more rows than one
    thread's share, eps None (float32's) and a column slice of a wider gradient (the input norm's)."""
    g = torch.Generator().manual_seed(3)
    for rows, width, eps in ((1, 8, 1e-6), (300, 64, None), (257, 139, 1e-5)):
        x = torch.randn(rows, width, generator=g) * 3
        w = torch.randn(width, generator=g)
        wide = torch.randn(rows, width + 11, generator=g)
        dy = wide[:, :width]  # rows of stride width + 11
        y, rstd = torch.ops.triroute.rms_norm_rstd(x, w, eps if eps is not None else torch.finfo(torch.float32).eps)
        y_ref, rstd_ref = torch.ops.aten._fused_rms_norm(x, [width], w, eps)
        torch.testing.assert_close(rstd, rstd_ref, rtol=1e-6, atol=0)
        torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
        dx, dw = torch.ops.triroute.rms_norm_backward(dy, x, rstd, w)
        dx_ref, dw_ref = _rms_norm_torch_backward(dy, x, rstd_ref, w)
        torch.testing.assert_close(dx, dx_ref, rtol=1e-5, atol=1e-6 * float(dx_ref.abs().max()))
        torch.testing.assert_close(dw, dw_ref, rtol=1e-5, atol=1e-6 * float(dw_ref.abs().max()))
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        torch.nn.functional.rms_norm(xa, [width], wa, eps).backward(dy)
        torch.testing.assert_close(dx, xa.grad, rtol=1e-5, atol=1e-6 * float(xa.grad.abs().max()))
        torch.testing.assert_close(dw, wa.grad, rtol=1e-5, atol=1e-6 * float(wa.grad.abs().max()))
        # what the trunk's functions take on this CPU: one call each
        ops = StepCounter()
        with ops:
            _, r = _rms_norm(x, w, eps)
            _rms_norm_backward(dy, x, r, w)
        assert ops.ops == 2, ops.ops
    torch.library.opcheck(torch.ops.triroute.rms_norm_rstd, (x, w, 1e-6))
    torch.library.opcheck(torch.ops.triroute.rms_norm_backward, (dy, x, rstd, w))


def test_the_fused_kernels_arguments_as_called_on_a_gpu_give_the_formula():
    """The call the GPU path makes (`_fused_rms_norm_backward(dy, x, [D], rstd, w, [True, True])`),
    run through PyTorch's reference decomposition of that op on the CPU, equals the formula."""
    from torch._decomp import decomposition_table

    fused = decomposition_table[torch.ops.aten._fused_rms_norm_backward.default]
    g = torch.Generator().manual_seed(1)
    x, w, dy = torch.randn(50, 24, generator=g), torch.randn(24, generator=g), torch.randn(50, 24, generator=g)
    _, rstd = _rms_norm(x, w, 1e-6)
    got = fused(dy, x, [24], rstd, w, [True, True])
    for a, b in zip(got, _rms_norm_backward(dy, x, rstd, w)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_backward_on_cuda_takes_the_fused_kernel_and_equals_the_formula(x_dtype):
    """On CUDA the fused kernel, with a bf16 input and float32 gradients as under autocast: one op,
    and the CPU formula's values."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 96, generator=g).to(x_dtype)
    w, dy = torch.randn(96, generator=g), torch.randn(300, 96, generator=g)
    _, rstd = _rms_norm(x.float(), w, 1e-6)
    want = _rms_norm_backward(dy, x, rstd, w)
    from torch.utils._python_dispatch import TorchDispatchMode

    class Names(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []  # this call's ops only (a class-level list would carry the other dtype's)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    args = dy.cuda(), x.cuda(), rstd.cuda(), w.cuda()
    with Names() as names:
        got = _rms_norm_backward(*args)
    assert names.seen.count("aten._fused_rms_norm_backward") == 1 and "aten.mul" not in names.seen
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-5)


def test_the_training_logits_dispatch_fewer_ops_than_the_modules_under_autograd():
    """What the hand-derived backward is for: counted, forward and backward of one layer's logits
    dispatch at most 70 % of the aten ops the modules dispatch under autograd (measured: 66 against
    209 at this shape, the parameters' gradient accumulation included)."""
    cfg = tiny_config()
    hidden, side = make_inputs(cfg)
    counts = []
    for run in (lambda c, h, s: c.logits(h, s), autograd_logits):
        ctrl = TriRouteController(cfg, 0).train()
        h = hidden.clone().requires_grad_()
        ops = StepCounter()
        with ops:
            out = run(ctrl, h, side)
            sum(z.sum() for z in out.values()).backward()
        counts.append(ops.ops)
    assert counts[0] <= 0.7 * counts[1], counts


def test_every_module_whose_parameters_are_read_sees_its_forward_pre_hooks():
    """The logits read the modules' parameters without calling them; a data-parallel engine that
    all-gathers parameters during the forward waits for them in forward pre-hooks, so those run
    for every module holding a parameter read (training), and for the heads when evaluation folds
    them (tests/training/test_dp_engine.py covers the engine itself)."""
    cfg = tiny_config()
    hidden, side = make_inputs(cfg)
    ctrl = TriRouteController(cfg, 0)
    seen = []
    holders = [m for m in ctrl.modules() if any(True for _ in m.parameters(recurse=False))]
    for m in holders:
        m.register_forward_pre_hook(lambda mod, args, seen=seen: seen.append(mod))
    ctrl.train().logits(hidden, side)
    assert {id(m) for m in holders} <= {id(m) for m in seen}
    seen.clear()
    with torch.no_grad():
        ctrl.eval().logits(hidden, side)
    assert {id(m) for m in holders} <= {id(m) for m in seen}
