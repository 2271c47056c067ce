"""Independent combo: a MoD block router and a separate MoE router, uniform KV bits."""

import math

import pytest
import torch

from megatron_triroute.config import ConfigError
from megatron_triroute.routing.modes import ATTN_MODES
from megatron_triroute.routing.cost import dense_cost, expected_cost, expert_width, noise_free_cost
from megatron_triroute.routing.factory import build_controller
from megatron_triroute.routing.independent import IndependentController
from megatron_triroute.routing.losses import router_aux_loss
from megatron_triroute.routing.mod import capacity_tokens
from megatron_triroute.routing.quant import kv_bits_per_token
from megatron_triroute.systems import system_config

from .helpers import make_inputs, tiny_config

SKIP, FULL = ATTN_MODES.index("skip"), ATTN_MODES.index("full")


def build(seed=0, train=True):
    cfg = system_config("independent", tiny_config())
    torch.manual_seed(seed)
    c = build_controller(cfg, 0)
    assert isinstance(c, IndependentController)
    return c.train(train), cfg


def test_the_expert_router_shares_no_parameter_with_the_mod_router():
    c, _ = build()
    mod = {id(p) for p in c.block.parameters()}
    moe = {id(p) for p in c.moe_router.parameters()}
    assert mod and moe and not mod & moe
    assert len(list(c.parameters())) == len(mod) + len(moe)


def test_expert_router_losses_do_not_reach_the_mod_router_and_vice_versa():
    c, cfg = build()
    out = c(*make_inputs(cfg), None, 1.0, None)
    aux, _ = router_aux_loss(out, cfg.losses)
    aux.backward(retain_graph=True)
    assert all(p.grad is None for p in c.block.parameters())
    assert c.moe_router.heads["experts"].proj.weight.grad.abs().sum() > 0
    c.zero_grad(set_to_none=True)
    out.extra_loss.backward()
    assert all(p.grad is None for p in c.moe_router.parameters())
    assert c.block.predictor[0].weight.grad.abs().sum() > 0


def test_skipped_tokens_run_no_expert_and_processed_ones_run_the_moe_routers_top_k():
    c, cfg = build()
    hidden, side = make_inputs(cfg)
    out = c(hidden, side, None, 1.0, None)
    processed = out.attn.hard[..., 0] == FULL  # (B, T)
    k, E = cfg.router.top_k, cfg.router.num_experts
    assert processed.sum(-1).tolist() == [capacity_tokens(0.5, cfg.model.seq_len)] * 2
    assert (out.experts.index[~processed] == -1).all()
    routed = out.experts.index[processed]  # (N, k)
    assert ((routed >= 0) & (routed < E)).all() and (routed[:, 0] != routed[:, 1]).all()
    alone = c.moe_router(hidden, side, None, 1.0, None).experts  # the same router, unmasked
    assert torch.equal(routed, alone.index[processed])
    assert torch.equal(out.experts.weight[processed].detach(), alone.weight[processed].detach())  # g = 1
    assert torch.allclose(out.experts.weight[processed].sum(-1), torch.ones(int(processed.sum())))
    assert k == 2 and out.expert_logits.shape[-1] == E  # no null option
    # The block skip is whole-token: skip on every head, full on every head otherwise.
    assert (out.attn.hard[~processed] == SKIP).all() and (out.attn.hard[processed] == FULL).all()


def test_mod_router_weight_scales_processed_tokens_expert_outputs():
    c, cfg = build()
    out = c(*make_inputs(cfg), None, 1.0, None)
    out.experts.weight.sum().backward()
    assert c.block.score.weight.grad.abs().sum() > 0  # via g on processed tokens


def test_bits_are_the_uniform_width_with_no_bit_head():
    c, cfg = build()
    out = c(*make_inputs(cfg), None, 1.0, None)
    assert cfg.router.uniform_bits == 4 and not cfg.router.bit_routing
    assert out.bits.logits is None and out.bits.y.shape[-1] == 1 and (out.bits.hard == 0).all()
    m = cfg.model
    hard = noise_free_cost(out, torch.arange(m.seq_len), m, cfg.router)
    expected = kv_bits_per_token(4, m.d_kv, cfg.router.group_size_for(m))
    assert (hard.kv_bits == expected).all() and expected < 2 * m.d_kv * 16


def test_cost_model_and_balancing_losses_run_on_the_output():
    c, cfg = build()
    out = c(*make_inputs(cfg), None, 1.0, None)
    m, r = cfg.model, cfg.router
    pos = torch.arange(m.seq_len)
    processed = (out.attn.hard[..., 0] == FULL).double()
    hard = noise_free_cost(out, pos, m, r)
    assert torch.equal(hard.experts_run, processed * r.top_k)
    dense = dense_cost(pos, m)
    ffn = r.top_k * 3.0 * m.d_model * expert_width(m, r)
    assert torch.equal(hard.flops, processed * (dense.flops - 3.0 * m.d_model * m.d_ff + ffn))
    relaxed = expected_cost(out, pos, m, r)
    assert torch.allclose(relaxed.flops, hard.flops)
    # Without a null expert every processed token runs exactly top_k experts whichever it picks, so
    # the cost surrogate has no gradient into the expert router (nothing a selection could save).
    assert not relaxed.flops.requires_grad or torch.autograd.grad(
        relaxed.flops.sum(), c.moe_router.heads["experts"].proj.weight, retain_graph=True, allow_unused=True)[0] is None
    aux, terms = router_aux_loss(out, cfg.losses)
    assert math.isfinite(aux.item()) and aux.requires_grad
    assert "experts/load" in terms and "attn/load" not in terms and "bits/load" not in terms


def test_eval_decisions_are_causal():
    c, cfg = build(train=False)
    hidden, side = make_inputs(cfg)
    out = c(hidden, side, None, 1.0, None)
    t0 = 6
    hidden2, side2 = hidden.clone(), side.clone()
    hidden2[:, t0 + 1 :] = torch.randn_like(hidden2[:, t0 + 1 :]) * 5
    side2[:, t0 + 1 :] = torch.randn_like(side2[:, t0 + 1 :])
    out2 = c(hidden2, side2, None, 1.0, None)
    for a, b in ((out.attn.hard, out2.attn.hard), (out.experts.index, out2.experts.index),
                 (out.experts.weight, out2.experts.weight)):
        assert torch.equal(a[:, : t0 + 1], b[:, : t0 + 1])


def test_independent_refuses_a_null_expert_or_a_bit_head():
    for field, value in (("null_expert", True), ("bit_routing", True)):
        cfg = system_config("independent", tiny_config())
        setattr(cfg.router, field, value)
        with pytest.raises(ConfigError, match=rf"router.{field}=True.*independent"):
            build_controller(cfg, 0)
