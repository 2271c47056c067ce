"""Priced noise-free decisions (routing/pricing.py) against hand computations."""

import torch
import torch.nn.functional as F

from megatron_triroute.config import TriRouteConfig
from megatron_triroute.routing.controller import AxisDecision, RouterOutput
from megatron_triroute.routing.cost import dense_cost, hard_cost, noise_free_cost
from megatron_triroute.routing.gating import top_k_gating
from megatron_triroute.routing.pricing import option_cost_fractions, price_decisions


def small_config():
    cfg = TriRouteConfig()
    cfg.model.d_model, cfg.model.n_heads, cfg.model.n_kv_heads, cfg.model.d_ff = 8, 2, 1, 16
    cfg.router.num_experts, cfg.router.top_k, cfg.router.window, cfg.router.kv_group_size = 4, 2, 2, 4
    return cfg.validate()


def output(attn_logits, bit_logits, expert_logits, top_k=2):
    a = AxisDecision(F.one_hot(attn_logits.argmax(-1), 3).float(), None, attn_logits.argmax(-1), logits=attn_logits)
    b = AxisDecision(F.one_hot(bit_logits.argmax(-1), 4).float(), None, bit_logits.argmax(-1), logits=bit_logits)
    return RouterOutput(attn=a, bits=b, experts=top_k_gating(expert_logits, top_k, True), expert_logits=expert_logits)


def test_zero_prices_change_nothing():
    cfg = small_config()
    out = output(torch.randn(1, 3, 2, 3), torch.randn(1, 3, 4), torch.randn(1, 3, 5))
    assert price_decisions(out, torch.zeros(2, dtype=torch.float64), torch.arange(3), cfg.model, cfg.router) is out


def test_option_costs_are_fractions_of_the_dense_token():
    cfg = small_config()  # d=8, d_h=4, H=2, d_f=16, expert width 8, w=2, d_kv=4, group 4
    attn, expert, bits = option_cost_fractions(torch.tensor([3]), cfg.model, cfg.router, attn_heads=2)
    dense = 2 * 8 * 4 + 3 * 8 * 16  # 448 MACs at t=3
    assert torch.allclose(attn[0], torch.tensor([0.0, 2 * 4 * 3 / dense, 2 * 4 * 4 / dense], dtype=torch.float64))
    assert torch.allclose(expert, torch.tensor([3 * 8 * 8 / dense], dtype=torch.float64))
    assert torch.allclose(bits, torch.tensor([(16 + 64) / 128, (32 + 64) / 128, (64 + 64) / 128, 1.0], dtype=torch.float64))
    # A dense token (both heads full, two experts of half width) costs exactly 1 in these units.
    assert torch.allclose(2 * attn[0, 2] + 2 * expert[0] * 0.5 * 2, torch.tensor(2 * 32 / dense + 384 / dense, dtype=torch.float64))


def test_bits_price_moves_the_argmax_to_the_hand_computed_option():
    cfg = small_config()
    bit_logits = torch.tensor([[[0.0, 0.5, 0.6, 0.65]]])  # plain argmax: 16 bits
    out = output(torch.zeros(1, 1, 2, 3), bit_logits, torch.zeros(1, 1, 5))
    _, _, c = option_cost_fractions(torch.tensor([0]), cfg.model, cfg.router, 2)
    for mu in (0.1, 0.5, 2.0, 20.0):
        priced = price_decisions(out, torch.tensor([0.0, mu], dtype=torch.float64), torch.tensor([0]), cfg.model, cfg.router)
        expected = int((bit_logits[0, 0].double() - mu * c).argmax())
        assert priced.bits.hard.item() == expected
        assert torch.equal(priced.bits.y, F.one_hot(torch.tensor([[expected]]), 4).float())
    assert price_decisions(out, torch.tensor([0.0, 20.0], dtype=torch.float64), torch.tensor([0]),
                           cfg.model, cfg.router).bits.hard.item() == 0  # a high price buys the cheapest width


def test_flops_price_prefers_cheaper_modes_and_the_null_expert_with_unpriced_gates():
    cfg = small_config()
    T = 4
    attn_logits = torch.tensor([0.0, 0.1, 0.2]).expand(1, T, 2, 3).clone()  # full by a small margin
    expert_logits = torch.tensor([0.0, 1.0, 0.5, -1.0, -2.0]).expand(1, T, 5).clone()  # top-2 = experts 0, 1
    out = output(attn_logits, torch.zeros(1, T, 4), expert_logits)
    pos = torch.arange(T)
    before = noise_free_cost(out, pos, cfg.model, cfg.router).flops
    priced = price_decisions(out, torch.tensor([3.0, 0.0], dtype=torch.float64), pos, cfg.model, cfg.router)
    c_attn, c_exp, _ = option_cost_fractions(pos, cfg.model, cfg.router, 2)
    want_modes = (attn_logits[0, :, 0].double() - 3.0 * c_attn).argmax(-1)  # (T,)
    assert torch.equal(priced.attn.hard[0, :, 0], want_modes) and torch.equal(priced.attn.hard[0, :, 1], want_modes)
    shift = (3.0 * c_exp).view(T, 1).expand(T, 5).clone()
    shift[:, 0] = 0.0
    want = top_k_gating(expert_logits[0].double() - shift, 2, True)
    assert torch.equal(priced.experts.index[0], want.index)
    p = torch.softmax(expert_logits[0], -1).gather(-1, want.option)
    assert torch.allclose(priced.experts.weight[0], p / p.sum(-1, keepdim=True))
    after = hard_cost(priced.attn.hard, priced.experts.index, priced.bits.hard, pos, cfg.model, cfg.router).flops
    assert (after <= before).all() and (after < before).any()
    assert (priced.experts.index == -1).any()  # the null expert entered some token's top-2
    assert dense_cost(pos, cfg.model).flops.shape == after.shape[1:]


def test_one_price_row_per_request_equals_each_request_priced_alone():
    """(B, 2) prices with per-request positions against the (2,) path row by row, and the shifts
    computed once for several layers give the same decisions."""
    from megatron_triroute.routing.pricing import price_shifts

    cfg = small_config()
    torch.manual_seed(3)
    B, T = 3, 4
    out = output(torch.randn(B, T, 2, 3), torch.randn(B, T, 4), torch.randn(B, T, 5))
    prices = torch.tensor([[0.0, 0.0], [2.5, -0.3], [-1.0, 4.0]], dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8], [2, 3, 4, 5]])
    rows = price_decisions(out, prices, positions, cfg.model, cfg.router)
    shifted = price_decisions(out, price_shifts(prices, positions, cfg.model, cfg.router, 2), positions, cfg.model,
                              cfg.router)
    for b in range(B):
        one = output(out.attn.logits[b:b + 1], out.bits.logits[b:b + 1], out.expert_logits[b:b + 1])
        alone = price_decisions(one, prices[b], positions[b], cfg.model, cfg.router)
        for got in (rows, shifted):
            assert torch.equal(got.attn.hard[b], alone.attn.hard[0]), b
            assert torch.equal(got.bits.hard[b], alone.bits.hard[0]), b
            assert torch.equal(got.experts.index[b], alone.experts.index[0]), b
            assert torch.allclose(got.experts.weight[b], alone.experts.weight[0], atol=1e-7), b
    assert not torch.equal(rows.bits.hard[2], out.bits.hard[2])  # a row's price moved its decisions
