import pytest
import torch

from megatron_triroute import TriRouteController
from megatron_triroute.routing.whitened_heads import heads_backward_torch, heads_torch, whitened_heads
from megatron_triroute.routing.whitening import RunningWhitening
from tests.dispatched import DispatchedOps
from triroute_kernels import cpu_ops_available

from .helpers import make_inputs, tiny_config

needs_kernels = pytest.mark.skipif(not cpu_ops_available(), reason="the C++ kernels are not built here")


def _heads(widths, seed=0):
    """Whitening modules away from their init, and gains and biases, for heads of `widths`."""
    g = torch.Generator().manual_seed(seed)
    heads = [RunningWhitening(d) for d in widths]
    for m in heads:
        m.mean.copy_(torch.randn(m.mean.shape, generator=g))
        m.var.copy_(torch.rand(m.var.shape, generator=g) * 2 + 0.1)
    gain = [torch.rand(d, generator=g) + 0.5 for d in widths]
    bias = [torch.randn(d, generator=g) for d in widths]
    return heads, gain, bias, g


@needs_kernels
@pytest.mark.parametrize("widths", [(12, 5, 4), (7,), (3, 9)])
def test_the_kernel_gives_the_definitions_values_and_statistics_in_one_call(widths):
    """z, s and du bit for bit; the accumulators (count, float64 sums) as the definition's within
    float64 rounding; d gain and d bias within float32 rounding of exact sums; u a column slice (rows
    of a wider stride), one dispatched op each way."""
    heads, gain, bias, g = _heads(widths)
    twins = _heads(widths)[0]
    D = sum(widths)
    u = (torch.randn(301, D + 5, generator=g) * 3)[:, 2:2 + D]
    dz = torch.randn(301, D, generator=g)
    RunningWhitening.standardisation(heads)  # made once per commit (its four ops), then kept
    with DispatchedOps() as ops:
        z, s, denom, backward = whitened_heads(heads, u, gain, bias)
    assert ops.names == ["whiten_heads"]
    want_z, want_s = heads_torch(twins, u, gain, bias)
    assert torch.equal(z, want_z) and torch.equal(s, want_s)
    for m, t in zip(heads, twins):
        assert m._acc[0] == 301 and t._acc[0] == 301
        torch.testing.assert_close(m._acc, t._acc, rtol=1e-13, atol=0.0)
    with DispatchedOps() as ops:
        du, d_gain, d_bias = backward(dz, s, denom, gain)
    assert ops.names == ["whiten_heads_backward"]
    assert torch.equal(denom, RunningWhitening.standardisation(twins)[1])
    want_du, want_gain, want_bias = heads_backward_torch(dz, want_s, denom, gain)
    assert torch.equal(du, want_du)
    exact_gain = (dz.double() * s.double()).sum(0).split(list(widths))
    exact_bias = dz.double().sum(0).split(list(widths))
    for got, want, exact in zip([*d_gain, *d_bias], [*want_gain, *want_bias], [*exact_gain, *exact_bias]):
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernels
def test_evaluation_accumulates_nothing_and_a_non_float32_head_takes_the_tensor_ops():
    heads, gain, bias, g = _heads((4, 3))
    u = torch.randn(9, 7, generator=g)
    for m in heads:
        m.eval()
    z, s, _, _ = whitened_heads(heads, u, gain, bias)
    assert all(m._acc.abs().sum() == 0 for m in heads)
    assert torch.equal(z, heads_torch(heads, u, gain, bias)[0])
    double = [b.double() for b in bias]
    with DispatchedOps() as ops:
        *_, backward = whitened_heads(heads, u, gain, double)
    assert backward is None and "whiten_heads" not in ops.names


@needs_kernels
def test_the_controllers_training_logits_take_one_call_each_way():
    """Through `SharedTrunkLogits`: the heads' whitening, gain and bias are one kernel call each way,
    and the standardisation is made once per commit, not per call."""
    cfg = tiny_config()
    hidden, side = make_inputs(cfg)
    ctrl = TriRouteController(cfg, 0).train()
    ctrl.logits(hidden, side)
    with DispatchedOps() as ops:
        out = ctrl.logits(hidden.clone().requires_grad_(), side)
        sum(z.sum() for z in out.values()).backward()
    assert ops.names.count("whiten_heads") == 1 and ops.names.count("whiten_heads_backward") == 1
    assert "sqrt" not in ops.names
