import torch

from megatron_triroute.routing.gating import NULL_EXPERT, top_k_gating
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
    (r.weight * torch.tensor([[1.0, 2.0]])).sum().backward()
    assert logits.grad[0, 2] == 0  # unselected option gets no gradient
    assert logits.grad[0, 1] != 0 and logits.grad[0, 3] != 0
