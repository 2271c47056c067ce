"""The relaxed attention's mode mix (`model/mode_mix.py`): the C++ kernels against the tensor ops
that define them, and the node's one call each way. The Triton kernels are checked under the
interpreter (tests/kernels/interpret_cases.py)."""

import pytest
import torch
import torch.nn.functional as F
from triroute_kernels import cpu_ops_available

from megatron_triroute.model.mode_mix import ModeMix, mix_backward_torch, mix_kernels, mix_torch
from megatron_triroute.routing.modes import N_MODES, READING_MODES, SKIP
from tests.dispatched import DispatchedOps

COLUMNS = list(READING_MODES)


def _case(d: int, soft: bool, seed: int = 0):
    """modes as the layer passes them (its heads' slice of every head's, so not contiguous), one
    attention output contiguous and one transposed (the full attention's layout), a gradient."""
    g = torch.Generator().manual_seed(seed + d)
    logits = torch.randn(2, 7, 6, N_MODES, generator=g)
    every_head = logits.softmax(-1) if soft else F.one_hot(logits.argmax(-1), N_MODES).float()
    modes = every_head[:, :, 1:5]
    attn = (torch.randn(2, 7, 4, d, generator=g), torch.randn(2, 4, 7, d, generator=g).transpose(1, 2))
    return modes, attn, torch.randn(2, 7, 4, d, generator=g)


def _exact_dots(grad, attn):
    return [(grad.double() * a.double()).sum(-1) for a in attn]


@pytest.fixture(scope="module", autouse=True)
def _built():
    assert cpu_ops_available(), "the C++ kernels did not build here"


@pytest.mark.parametrize("d", [8, 13, 64])
@pytest.mark.parametrize("soft", [False, True])
def test_cpu_kernels_give_the_definitions_values(d, soft):
    """Forward and d attn bit for bit (soft weights too: the kernel fuses the second term's
    multiply-add as PyTorch's `addcmul` does), d modes within float32 rounding of the exact sums and
    zero in SKIP's column; the output token-major, each d attn_m laid out as attn_m. d = 13 leaves
    channels past the last eight."""
    modes, attn, grad = _case(d, soft)
    out = torch.ops.triroute.mode_mix(modes, list(attn), COLUMNS)
    assert torch.equal(out, mix_torch(modes, attn))
    assert out.transpose(0, 1).is_contiguous()
    d_modes, d_attn = torch.ops.triroute.mode_mix_backward(grad, modes, list(attn), COLUMNS)
    ref_modes, ref_attn = mix_backward_torch(grad, modes, attn)
    for got, want, a in zip(d_attn, ref_attn, attn):
        assert torch.equal(got, want) and got.stride() == a.stride()
    assert torch.equal(d_modes[..., SKIP], torch.zeros_like(d_modes[..., SKIP]))
    for m, exact in zip(COLUMNS, _exact_dots(grad, attn)):
        torch.testing.assert_close(d_modes[..., m].double(), exact, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(d_modes, ref_modes, rtol=1e-5, atol=1e-5)


def test_cpu_kernels_refuse_what_they_do_not_take():
    modes, attn, grad = _case(8, False)
    with pytest.raises(RuntimeError, match="contiguous channels"):
        torch.ops.triroute.mode_mix(modes, [attn[0], attn[1].transpose(2, 3)], COLUMNS)
    with pytest.raises(RuntimeError, match="one modes column per attention output"):
        torch.ops.triroute.mode_mix(modes, list(attn), COLUMNS[:1])
    with pytest.raises(RuntimeError, match="is not a mode"):
        torch.ops.triroute.mode_mix(modes, list(attn), [1, N_MODES])
    assert mix_kernels(modes.double(), tuple(a.double() for a in attn)) is None  # float64: the tensor ops


def test_the_node_calls_one_kernel_each_way_with_autograds_gradients():
    """Under autograd the node dispatches the forward kernel once and the backward kernel once,
    no elementwise op beside them, and gives the gradients autograd computes through the tensor
    ops (the modes' within rounding)."""
    modes, attn, grad = _case(16, False)
    leaves = [modes.clone().requires_grad_(), *(a.clone().requires_grad_() for a in attn)]
    ops = DispatchedOps()
    with ops:
        out = ModeMix.apply(*leaves)
    assert ops.names == ["mode_mix"], ops.names
    ops.names.clear()
    with ops:
        got = torch.autograd.grad(out, leaves, grad)
    assert "mode_mix_backward" in ops.names and not {"mul", "addcmul", "sum", "stack"} & set(ops.names), ops.names
    chain_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    want = torch.autograd.grad(mix_torch(chain_leaves[0], tuple(chain_leaves[1:])), chain_leaves, grad)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    for a, b in zip(got[1:], want[1:]):
        assert torch.equal(a, b)


def test_the_node_keeps_the_definition_where_no_kernel_takes_the_tensors():
    """float64 tensors (no kernel): the tensor ops, forward and backward, values and gradients as
    autograd's through them."""
    modes, attn, grad = _case(8, True)
    leaves = [modes.double().requires_grad_(), *(a.double().requires_grad_() for a in attn)]
    ops = DispatchedOps()
    with ops:
        out = ModeMix.apply(*leaves)
    assert "mode_mix" not in ops.names and "addcmul_" in ops.names
    assert torch.equal(out, mix_torch(*[t.detach() for t in leaves[:1]], tuple(t.detach() for t in leaves[1:])))
    got = torch.autograd.grad(out, leaves, grad.double())
    chain = [t.detach().clone().requires_grad_() for t in leaves]
    want = torch.autograd.grad(mix_torch(chain[0], tuple(chain[1:])), chain, grad.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
