import pytest
import torch

from megatron_triroute.routing.gating import NULL_EXPERT, renormalised_gates, top_k_gating
from tests.oracles import combine_experts, hard_experts, swiglu


def _experts(d=6, d_e=5, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [swiglu(torch.randn(d, d_e, generator=g), torch.randn(d, d_e, generator=g), torch.randn(d_e, d, generator=g))
            for _ in range(n)]


def test_k1_null_gives_exactly_zero_ffn_output():
    logits = torch.tensor([[3.0, 0.0, 1.0, 0.5], [0.0, 3.0, 1.0, 0.5]])  # token 0 -> null, token 1 -> expert 0
    r = top_k_gating(logits, 1, True)
    assert r.index.tolist() == [[NULL_EXPERT], [0]]
    assert torch.equal(r.weight, torch.ones(2, 1))
    x = torch.randn(2, 6)
    ex = _experts()
    out = hard_experts(x, r.index, r.weight, ex)
    assert torch.equal(out[0], torch.zeros(6))
    assert torch.allclose(out[1], ex[0](x[1:2])[0])


def test_k2_null_plus_expert_runs_one_expert_with_renormalised_gate():
    logits = torch.log(torch.tensor([[0.4, 0.1, 0.3, 0.2]]))  # S = {null (0.4), expert 1 (0.3)}
    r = top_k_gating(logits, 2, True)
    assert r.index.tolist() == [[NULL_EXPERT, 1]]
    assert torch.allclose(r.weight, torch.tensor([[0.4 / 0.7, 0.3 / 0.7]]))
    x = torch.randn(1, 6)
    ex = _experts()
    calls = []
    counted = [lambda t, f=f, j=j: (calls.append(j), f(t))[1] for j, f in enumerate(ex)]
    out = hard_experts(x, r.index, r.weight, counted)
    assert calls == [1]
    assert torch.allclose(out, (0.3 / 0.7) * ex[1](x), atol=1e-6)
    assert torch.allclose(combine_experts(x, r.index, r.weight, ex), out, atol=1e-6)


def test_without_null_expert_indices_are_real():
    r = top_k_gating(torch.randn(50, 3), 2, False)
    assert (r.index >= 0).all() and r.probs.shape[-1] == 3


def test_gate_gradient_flows_through_selected_probabilities():
    logits = torch.tensor([[0.2, 1.0, -0.5, 0.3]], requires_grad=True)
    r = top_k_gating(logits, 2, True)
    r.probs.retain_grad()
    (r.weight * torch.tensor([[1.0, 2.0]])).sum().backward()
    assert r.probs.grad[0, 0] == 0 and r.probs.grad[0, 2] == 0  # unselected options: exactly none
    assert r.probs.grad[0, 1] != 0 and r.probs.grad[0, 3] != 0
    # through the softmax an unselected logit gets -p_j sum_S p dp, which is 0 up to rounding
    assert logits.grad[0, 2].abs() <= 1e-6 * logits.grad.abs().max()
    assert logits.grad[0, 1] != 0 and logits.grad[0, 3] != 0


def _autograd_gates(probs, option):
    """The gates through autograd's own chain: the reference for `_RenormalisedGates`."""
    chosen = probs.gather(-1, option)
    return chosen / chosen.sum(-1, keepdim=True).clamp_min(1e-20)


def test_gates_node_equals_autograd_chain_values_and_gradient():
    from megatron_triroute.routing.gating import option_probs, renormalised_gates
    g = torch.Generator().manual_seed(3)
    for shape, k in (((2, 7, 5), 2), ((3, 4, 9), 3), ((5, 3), 1)):
        logits = (torch.randn(shape, generator=g) * 3).requires_grad_()
        probs = option_probs(logits)
        option = torch.sort(probs, dim=-1, descending=True, stable=True).indices[..., :k]
        upstream = torch.randn(*shape[:-1], k, generator=g)
        ours = renormalised_gates(probs, option)
        (d_ours,) = torch.autograd.grad((ours * upstream).sum(), logits, retain_graph=True)
        ref = _autograd_gates(probs, option)
        (d_ref,) = torch.autograd.grad((ref * upstream).sum(), logits)
        assert torch.equal(ours, ref)
        torch.testing.assert_close(d_ours, d_ref, rtol=1e-5, atol=1e-7)
        assert ours.grad_fn is not None and "RenormalisedGates" in type(ours.grad_fn).__name__


def test_gates_node_backward_takes_fewer_ops_than_the_chain():
    from torch.utils._python_dispatch import TorchDispatchMode
    from megatron_triroute.routing.gating import renormalised_gates

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    def backward_ops(fn):
        probs = torch.softmax(torch.randn(64, 5), -1).requires_grad_()
        option = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :2]
        w = fn(probs, option)
        Count.n = 0
        with Count():
            w.backward(torch.ones_like(w))
        return Count.n

    ours, chain = backward_ops(renormalised_gates), backward_ops(_autograd_gates)
    assert ours + 5 <= chain, (ours, chain)  # six ops written out against about a dozen


@pytest.mark.parametrize("n, k", [(5, 2), (9, 1), (4, 3), (16, 4)])
def test_gate_kernels_give_the_definitions_bits_in_one_call_each_way(n, k):
    """Float32 CPU rows: `top_k_gates` dispatches one `top_k_gates` call forward and one backward
    call, and gives the options (a stable descending sort's, so a tied row takes the lowest ones),
    the gates and their gradient to the probabilities of the tensor ops bit for bit."""
    from triroute_kernels import cpu_ops_available

    from megatron_triroute.routing.gating import top_k_gates
    from tests.dispatched import DispatchedOps

    assert cpu_ops_available(), "the C++ kernels did not build here"

    g = torch.Generator().manual_seed(n * 10 + k)
    probs = torch.randn(300, n, generator=g).softmax(-1)
    probs[0] = 1.0 / n
    grad = torch.randn(300, k, generator=g)
    p = probs.clone().requires_grad_()
    with DispatchedOps() as ops:
        option, weight = top_k_gates(p, k)
        (d,) = torch.autograd.grad(weight, [p], grad)
    assert ops.names == ["top_k_gates", "top_k_gates_backward"], ops.names
    q = probs.clone().requires_grad_()
    want_option = torch.sort(q, dim=-1, descending=True, stable=True).indices[..., :k]
    want_weight = renormalised_gates(q, want_option)
    (want_d,) = torch.autograd.grad(want_weight, [q], grad)
    assert torch.equal(option, want_option) and option[0].tolist() == list(range(k))
    assert torch.equal(weight, want_weight) and torch.equal(d, want_d)
