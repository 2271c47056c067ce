import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from megatron_triroute.config import TriRouteConfig
from megatron_triroute.routing.controller import AxisDecision, RouterOutput
from megatron_triroute.routing.cost import (budget_fractions, dense_cost, expected_cost, expert_count_surrogate,
                                           expert_width, hard_cost)
from megatron_triroute.routing.gating import top_k_gating
from tests.oracles import hard_attention, hard_experts, pack_kv, swiglu
from triroute_kernels import cpu_ops_available


def small_config():
    cfg = TriRouteConfig()
    cfg.model.d_model, cfg.model.n_heads, cfg.model.n_kv_heads, cfg.model.d_ff = 8, 2, 1, 16
    cfg.router.num_experts, cfg.router.top_k, cfg.router.window, cfg.router.kv_group_size = 4, 2, 2, 4
    return cfg.validate()


def hand_output(modes, expert_logits, bit_option, n_bits=4):
    """RouterOutput with given hard decisions; modes (B, T, H) ints."""
    y_attn = F.one_hot(modes, 3).float()
    y_bits = F.one_hot(bit_option, n_bits).float()
    routes = top_k_gating(expert_logits, 2, True)
    return RouterOutput(
        attn=AxisDecision(y_attn, y_attn, modes), bits=AxisDecision(y_bits, y_bits, bit_option),
        experts=routes, expert_logits=expert_logits,
    )


def test_expected_cost_hand_computation():
    cfg = small_config()  # d=8, H=2, d_h=4, d_kv=4, expert width ceil(16/2)=8, w=2, group 4
    assert expert_width(cfg.model, cfg.router) == 8
    # One token at position t=3: head 0 local, head 1 full; experts {null, expert 1}; 4-bit KV.
    modes = torch.tensor([[[1, 2]]])
    logits = torch.log(torch.tensor([[[0.5, 0.05, 0.3, 0.1, 0.05]]]))  # null=0.5, expert1 (option 2)=0.3
    out = hand_output(modes, logits, torch.tensor([[1]]))
    cost = expected_cost(out, torch.tensor([3]), cfg.model, cfg.router)
    # local reads min(3, 2) + 1 = 3 keys, full reads 4: 2 * d_h * (3 + 4) = 56 MACs.
    # one real expert: 3 * d * d_e = 3 * 8 * 8 = 192 MACs.
    assert cost.flops.item() == 56 + 192
    # 4 bits: 2 * d_kv * 4 = 32 payload bits + (2 * 4 / 4 = 2 groups) * 32 metadata bits.
    assert cost.mem.item() == 32 + 64
    dense = dense_cost(torch.tensor([3]), cfg.model)
    assert dense.flops.item() == 2 * 8 * 4 + 3 * 8 * 16
    assert dense.mem.item() == 2 * 4 * 16
    hard = hard_cost(modes, out.experts.index, torch.tensor([[1]]), torch.tensor([3]), cfg.model, cfg.router)
    assert hard.flops.item() == cost.flops.item() and hard.kv_bits.item() == cost.mem.item()


def test_expert_cost_gradient_acts_only_on_the_null_swap_margin():
    """Top-2 = two real experts: the cost's gradient is kappa_e * q(1 - q) on the weakest selected
    expert's logit and its negative on the null's, q = sigmoid(z_weakest - z_null); zero elsewhere."""
    cfg = small_config()
    logits = torch.tensor([[[0.1, 0.2, 0.9, 0.0, -1.0]]], requires_grad=True)  # top-2 = options 2, 1
    out = hand_output(torch.tensor([[[2, 2]]]), logits, torch.tensor([[3]]))
    cost = expected_cost(out, torch.tensor([0]), cfg.model, cfg.router)
    assert cost.flops.item() == 2 * 4 * 1 * 2 + 2 * 192  # both heads full at t=0, two experts
    cost.flops.sum().backward()
    q = 1.0 / (1.0 + math.exp(-(0.2 - 0.1)))  # weakest selected (option 1, z=0.2) vs null (z=0.1)
    expected = torch.tensor([-192 * q * (1 - q), 192 * q * (1 - q), 0.0, 0.0, 0.0])
    assert torch.allclose(logits.grad[0, 0].double(), expected.double(), atol=1e-9), logits.grad
    assert logits.grad[0, 0, 0] < 0  # raising the null logit lowers the cost


def test_expert_cost_has_no_gradient_once_the_null_is_selected():
    """S = {null, j}: one real expert runs whatever the logits do (the fewest possible with top-2 and
    one null), so no selection change can save anything and the cost pushes on nothing."""
    cfg = small_config()
    logits = torch.log(torch.tensor([[[0.90, 0.02, 0.05, 0.02, 0.01]]])).requires_grad_(True)
    out = hand_output(torch.tensor([[[0, 0]]]), logits, torch.tensor([[0]]))
    cost = expected_cost(out, torch.tensor([0]), cfg.model, cfg.router)
    assert out.experts.index.tolist() == [[[-1, 1]]]
    assert cost.flops.item() == 192  # exactly one expert of 3 * d * d_e MACs, heads skipped
    cost.flops.sum().backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_expert_count_surrogate_top1_and_without_null():
    z = torch.tensor([[0.3, 1.0, -0.5], [2.0, 0.1, 0.0]], requires_grad=True)  # option 0 = null
    routes = top_k_gating(z, 1, True)
    n = expert_count_surrogate(z, routes.index, True)
    assert n.tolist() == [1.0, 0.0]
    n.sum().backward()
    q = 1.0 / (1.0 + math.exp(-(1.0 - 0.3)))
    assert torch.allclose(z.grad.double(), torch.tensor([[-q * (1 - q), q * (1 - q), 0.0], [0.0, 0.0, 0.0]],
                                                        dtype=torch.float64), atol=1e-9)
    # No null expert: every token always runs k experts, so there is nothing to push on.
    z2 = torch.randn(4, 3, requires_grad=True)
    n2 = expert_count_surrogate(z2, top_k_gating(z2, 2, False).index, False)
    assert n2.tolist() == [2.0] * 4 and not n2.requires_grad


def test_budget_fraction_of_dense_policy_is_one_for_flops_and_mem():
    cfg = small_config()
    cfg.router.num_experts, cfg.model.d_ff = 4, 16
    T = 5
    modes = torch.full((1, T, 2), 2)
    logits = torch.tensor([-9.0, 1.0, 1.0, -5.0, -5.0]).expand(1, T, 5)  # two real experts
    out = hand_output(modes, logits, torch.full((1, T), 3))
    frac = budget_fractions([expected_cost(out, torch.arange(T), cfg.model, cfg.router)], torch.arange(T), cfg.model)
    assert torch.allclose(frac, torch.tensor([1.0, 1.0], dtype=torch.float64))


def test_hard_accounting_matches_independent_flop_count_and_bytes():
    torch.manual_seed(0)
    cfg = small_config()
    B, T, H, d, d_h = 2, 7, 2, 8, 4
    modes = torch.randint(0, 3, (B, T, H))
    logits = torch.randn(B, T, 5)
    routes = top_k_gating(logits, 2, True)
    assert (routes.index == -1).any(), "fixture should route some tokens to the null expert"
    q, k, v = torch.randn(B, T, H, d_h), torch.randn(B, T, 1, d_h), torch.randn(B, T, 1, d_h)
    d_e = expert_width(cfg.model, cfg.router)
    experts = [swiglu(torch.randn(d, d_e), torch.randn(d, d_e), torch.randn(d_e, d)) for _ in range(4)]
    x = torch.randn(B * T, d)
    with FlopCounterMode(display=False) as attn_counter:
        hard_attention(q, k, v, modes, cfg.router.window)
    with FlopCounterMode(display=False) as expert_counter:
        hard_experts(x, routes.index.view(-1, 2), routes.weight.view(-1, 2), experts)
    bit_option = torch.arange(B * T).view(B, T) % len(cfg.router.bits)  # every width, 2 to 16 bits
    acc = hard_cost(modes, routes.index, bit_option, torch.arange(T), cfg.model, cfg.router)
    # The counter reports FLOPs = 2 x MACs.
    assert attn_counter.get_total_flops() == 2 * acc.attn_key_macs.sum().item()
    assert expert_counter.get_total_flops() == 2 * acc.expert_macs.sum().item()
    # Bytes: each token's K and V of one layer, bit-packed at the width chosen for it (codes plus
    # the per-group scale and zero point), occupy exactly the bits the accounting charges.
    g = cfg.router.group_size_for(cfg.model)
    shape = (1, cfg.model.n_kv_heads, cfg.model.d_head)
    packed = torch.tensor([[8 * sum(pack_kv(torch.randn(shape), cfg.router.bits[int(bit_option[b, t])], g).nbytes
                                    for _ in ("k", "v")) for t in range(T)] for b in range(B)], dtype=torch.float64)
    assert torch.equal(acc.kv_bits, packed), (acc.kv_bits, packed)
    assert set(bit_option.flatten().tolist()) == set(range(len(cfg.router.bits)))


def test_all_skip_all_null_costs_no_attention_or_expert_work():
    cfg = small_config()
    cfg.router.top_k = 1
    B, T = 1, 4
    modes = torch.zeros(B, T, 2, dtype=torch.long)
    logits = torch.tensor([5.0, 0, 0, 0, 0]).expand(B, T, 5)
    routes = top_k_gating(logits, 1, True)
    q, k, v = torch.randn(B, T, 2, 4), torch.randn(B, T, 1, 4), torch.randn(B, T, 1, 4)
    with FlopCounterMode(display=False) as counter:
        out = hard_attention(q, k, v, modes, 2)
        ffn = hard_experts(torch.randn(T, 8), routes.index.view(-1, 1), routes.weight.view(-1, 1),
                           [swiglu(torch.randn(8, 8), torch.randn(8, 8), torch.randn(8, 8))] * 4)
    assert counter.get_total_flops() == 0
    assert torch.all(out == 0) and torch.all(ffn == 0)
    acc = hard_cost(modes, routes.index, torch.zeros(B, T, dtype=torch.long), torch.arange(T), cfg.model, cfg.router)
    assert acc.flops.sum().item() == 0


def test_micro_batch_constants_give_every_cost_bit_for_bit_and_are_computed_once():
    """`micro_batch_costs` (what every layer of a micro-batch shares: keys read per mode, the dense
    cost and its sums) passed in or recomputed: the same expected cost, hard cost and budget
    fractions bit for bit, for shared (T,) and per-sequence (B, T) positions; `RoutingInputs`
    computes them once."""
    from megatron_triroute.routing.cost import micro_batch_costs
    from megatron_triroute.routing.state import RoutingInputs

    cfg = small_config()
    g = torch.Generator().manual_seed(1)
    B, T = 3, 9
    modes = torch.randint(0, 3, (B, T, 2), generator=g)
    logits = torch.randn(B, T, 5, generator=g, requires_grad=True)
    out = hand_output(modes, logits, torch.randint(0, 4, (B, T), generator=g))
    for positions in (torch.arange(T), torch.arange(T).expand(B, T) + torch.tensor([[0], [4], [11]])):
        batch = micro_batch_costs(positions, B, cfg.model, cfg.router)
        alone, shared = (expected_cost(out, positions, cfg.model, cfg.router, b) for b in (None, batch))
        assert torch.equal(alone.flops, shared.flops) and torch.equal(alone.mem, shared.mem)
        h_alone, h_shared = (hard_cost(modes, out.experts.index, out.bits.hard, positions, cfg.model, cfg.router, b)
                             for b in (None, batch))
        assert torch.equal(h_alone.flops, h_shared.flops) and torch.equal(h_alone.kv_bits, h_shared.kv_bits)
        f_alone, f_shared = (budget_fractions([alone, alone], positions, cfg.model, b) for b in (None, batch))
        assert torch.equal(f_alone, f_shared)
        dense = dense_cost(positions, cfg.model)  # the denominator as written in Appendix A
        expected = torch.stack([alone.flops.sum() * 2 / (dense.flops.expand(B, -1).sum() * 2),
                                alone.mem.sum() * 2 / (dense.mem.expand(B, -1).sum() * 2)])
        torch.testing.assert_close(f_shared, expected, rtol=1e-15, atol=0)
    inputs = RoutingInputs(torch.zeros(B, T, 4), torch.arange(B))
    first = inputs.costs(cfg.model, cfg.router)
    assert inputs.costs(cfg.model, cfg.router) is first
    assert torch.equal(first.keys, micro_batch_costs(torch.arange(T), B, cfg.model, cfg.router).keys)


def test_expert_count_surrogate_gradient_equals_autograd_through_its_formula():
    """The written-out node against autograd through n_t + [null not in S_t] (q_t - sg q_t) on random
    logits, top-2 with and without the null selected, an upstream gradient other than one, float32
    logits (the gradient comes back in their dtype)."""
    g = torch.Generator().manual_seed(5)
    z = torch.randn(6, 9, 5, generator=g) * 2

    def reference(logits, index):
        real = index >= 0
        zz = logits.double()
        weakest = zz.gather(-1, index + 1).masked_fill(~real, float("inf")).amin(-1)
        has_null = (~real).any(-1)
        q = torch.sigmoid(torch.where(has_null, 0.0, weakest) - zz[..., 0])
        return real.sum(-1).double() + torch.where(has_null, 0.0, q - q.detach())

    index = top_k_gating(z, 2, True).index
    assert (index < 0).any() and (index >= 0).all(-1).any()  # both kinds of token present
    upstream = torch.rand(6, 9, generator=g, dtype=torch.float64) + 0.5
    grads = []
    for fn in (expert_count_surrogate, lambda lg, ix, _: reference(lg, ix)):
        logits = z.clone().requires_grad_(True)
        n = fn(logits, index, True)
        assert torch.equal(n, (index >= 0).sum(-1).double())
        (n * upstream).sum().backward()
        assert logits.grad.dtype == torch.float32
        grads.append(logits.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-6, atol=1e-9)
    assert grads[0].abs().sum() > 0


def test_layers_expected_cost_stacks_each_layers_own_cost_and_gradient():
    """S layers' decisions in one pass: each layer's (B, T) flops and mem, and the gradient of
    their total to every layer's relaxed decisions and expert logits, as S `expected_cost` calls."""
    from megatron_triroute.routing.cost import layers_expected_cost

    cfg = small_config()
    g = torch.Generator().manual_seed(3)
    B, T, S = 2, 5, 3
    positions = torch.arange(T)

    def layer_output():
        z_attn = torch.randn(B, T, 2, 3, generator=g, requires_grad=True)
        z_bits = torch.randn(B, T, 4, generator=g, requires_grad=True)
        logits = torch.randn(B, T, 5, generator=g, requires_grad=True)
        y_attn, y_bits = torch.softmax(z_attn, -1), torch.softmax(z_bits, -1)  # relaxed, differentiable
        return RouterOutput(attn=AxisDecision(y_attn, y_attn, z_attn.argmax(-1)),
                            bits=AxisDecision(y_bits, y_bits, z_bits.argmax(-1)),
                            experts=top_k_gating(logits, 2, True), expert_logits=logits), (z_attn, z_bits, logits)

    outs, leaves = zip(*(layer_output() for _ in range(S)))
    leaves = [t for group in leaves for t in group]
    together = layers_expected_cost(list(outs), positions, cfg.model, cfg.router)
    alone = [expected_cost(o, positions, cfg.model, cfg.router) for o in outs]
    assert together.flops.shape == (S, B, T)
    torch.testing.assert_close(together.flops, torch.stack([c.flops for c in alone]), rtol=1e-12, atol=0)
    torch.testing.assert_close(together.mem, torch.stack([c.mem for c in alone]), rtol=1e-12, atol=0)
    weights = torch.rand(S, B, T, generator=g, dtype=torch.float64)  # a different weight per layer and token
    want = torch.autograd.grad(sum((w * (c.flops + c.mem)).sum() for w, c in zip(weights, alone)), leaves,
                               retain_graph=True)
    got = torch.autograd.grad((weights * (together.flops + together.mem)).sum(), leaves)
    assert any(w.abs().sum() > 0 for w in want[2::3])  # the expert logits do get a gradient
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert layers_expected_cost([outs[0]], positions, cfg.model, cfg.router).flops.shape == (B, T)


@pytest.mark.skipif(not cpu_ops_available(), reason="the C++ kernels are not built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_null_swap_margin_is_one_kernel_call_each_way_with_the_definitions_values(dtype):
    """`_NullSwapMargin` on a CPU: one `null_swap_margin` call forward and one backward; the counts and
    the weakest experts exactly, the slope within float64 rounding (the kernel's sigmoid is
    1 / (1 + exp(-x))), the gradient's zeros exactly and its values within rounding; tokens with and
    without the null, only nulls, a tie between the selected experts (the first slot's)."""
    from megatron_triroute.routing.cost import null_swap_margin_backward_torch, null_swap_margin_torch
    from tests.dispatched import DispatchedOps

    g = torch.Generator().manual_seed(2)
    z = torch.randn(4, 9, 6, generator=g, dtype=dtype)
    index = torch.randint(-1, 5, (4, 9, 2), generator=g)
    index[0, 0] = torch.tensor([1, 3])
    z[0, 0, 2] = z[0, 0, 4]  # experts 1 and 3 tie: the first slot's is the weakest
    index[0, 1] = -1  # only nulls
    got = torch.ops.triroute.null_swap_margin(z, index)
    want = null_swap_margin_torch(z, index)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2]) and got[2][0, 0, 0] == 2
    torch.testing.assert_close(got[1], want[1], rtol=1e-13, atol=0.0)
    logits = z.clone().requires_grad_()
    with DispatchedOps() as ops:
        n = expert_count_surrogate(logits, index, True)
    assert ops.names == ["null_swap_margin"] and torch.equal(n, want[0])
    upstream = torch.rand(4, 9, generator=g, dtype=torch.float64)
    with DispatchedOps() as ops:
        n.backward(upstream)
    assert ops.names.count("null_swap_margin_backward") == 1 and len(ops.names) <= 2  # (and the grad's accumulation)
    reference = null_swap_margin_backward_torch(upstream, want[1], want[2], 6, dtype)
    assert torch.equal(logits.grad == 0, reference == 0)
    torch.testing.assert_close(logits.grad, reference, rtol=1e-6, atol=0.0)
