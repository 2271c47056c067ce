"""Mixture-of-Depths router: top-k in training, exact unit values, router gradient, the causal
predictor (learns membership, decides in eval, reads no future token)."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_triroute.config import ConfigError
from megatron_triroute.routing.modes import ATTN_MODES
from megatron_triroute.routing.cost import dense_cost, expected_cost, noise_free_cost
from megatron_triroute.routing.factory import build_controller
from megatron_triroute.routing.losses import router_aux_loss
from megatron_triroute.routing.mod import MoDConfig, MoDController, capacity_tokens
from megatron_triroute.systems import system_config

from .helpers import make_inputs, tiny_config

SKIP, LOCAL, FULL = (ATTN_MODES.index(m) for m in ("skip", "local", "full"))


def build(seed=0, **router_fields):
    cfg = system_config("mod", tiny_config())
    for name, value in router_fields.items():
        setattr(cfg.router, name, value)  # mod_* knobs are read with defaults until RouterConfig has them
    torch.manual_seed(seed)
    c = build_controller(cfg, 0)
    assert isinstance(c, MoDController)
    return c.train(), cfg


def scores(c, hidden):
    with torch.no_grad():
        return c.block.score(c.block.norm(hidden.float())).squeeze(-1)  # (B, T)


def test_capacity_rounds_half_up_and_keeps_at_least_one_token():
    assert capacity_tokens(0.5, 12) == 6
    assert capacity_tokens(0.125, 12) == 2  # 1.5 -> 2
    assert capacity_tokens(0.25, 10) == 3  # 2.5 -> 3 (half up, not to even)
    assert capacity_tokens(0.2, 12) == 2  # 2.4 -> 2
    assert capacity_tokens(0.01, 12) == 1
    assert capacity_tokens(1.0, 12) == 12


def test_training_processes_exactly_the_top_k_tokens_by_router_score():
    c, cfg = build()
    hidden, side = make_inputs(cfg, batch=3)
    out = c(hidden, side, None, 1.0, None)
    k = capacity_tokens(0.5, cfg.model.seq_len)
    processed = out.attn.hard[..., 0] == FULL  # (B, T)
    assert processed.sum(-1).tolist() == [k] * 3
    r = scores(c, hidden)
    for b in range(3):
        expected = set(r[b].topk(k).indices.tolist())
        assert set(processed[b].nonzero().flatten().tolist()) == expected
    # Whole-block decision: every head shares the token's mode, and only skip/full occur.
    assert torch.equal(out.attn.hard, out.attn.hard[..., :1].expand_as(out.attn.hard))
    assert set(out.attn.hard.unique().tolist()) == {SKIP, FULL}


def test_processed_tokens_carry_exact_unit_values_and_skipped_ones_exact_skip_and_null():
    c, cfg = build()
    out = c(*make_inputs(cfg), None, 1.0, None)
    H = cfg.model.n_heads
    processed = out.attn.hard[..., 0] == FULL
    y = out.attn.y.detach()
    full_onehot = F.one_hot(torch.tensor(FULL), 3).float().expand(H, 3)
    skip_onehot = F.one_hot(torch.tensor(SKIP), 3).float().expand(H, 3)
    for b, t in torch.cartesian_prod(torch.arange(2), torch.arange(cfg.model.seq_len)).tolist():
        if processed[b, t]:
            assert torch.equal(y[b, t], full_onehot)  # g has value exactly 1
            assert out.experts.index[b, t].tolist() == [0] and out.experts.weight[b, t].item() == 1.0
            assert out.experts.option[b, t].tolist() == [1]
        else:
            assert torch.equal(y[b, t], skip_onehot)
            assert out.experts.index[b, t].tolist() == [-1] and out.experts.option[b, t].tolist() == [0]
    assert torch.equal(out.attn.y_cost, out.attn.y)
    assert out.attn.logits is None and out.bits.logits is None
    assert out.bits.y.shape == (2, cfg.model.seq_len, 1)


def test_router_gradient_is_the_sigmoid_derivative_on_processed_tokens():
    c, cfg = build()
    hidden, side = make_inputs(cfg)
    out = c(hidden, side, None, 1.0, None)
    (out.attn.y[..., FULL].sum() + out.experts.weight.sum()).backward()
    r = scores(c, hidden)
    processed = out.attn.hard[..., 0] == FULL
    s = torch.sigmoid(r)
    # Each processed token has H attention gates and one expert gate, each d/dr = s (1 - s).
    expected = (cfg.model.n_heads + 1) * (s * (1 - s))[processed].sum()
    assert torch.allclose(c.block.score.bias.grad, expected.view(1), rtol=1e-5)
    assert c.block.score.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in c.block.predictor.parameters())  # the predictor is not on this path


def test_predictor_loss_is_isolated_from_the_router_and_the_residual_stream():
    c, cfg = build()
    hidden, side = make_inputs(cfg)
    hidden.requires_grad_(True)
    out = c(hidden, side, None, 1.0, None)
    out.extra_loss.backward()
    assert c.block.score.weight.grad is None  # BCE targets are detached top-k labels
    assert hidden.grad is None  # the predictor reads sg(Norm(x))
    assert c.block.predictor[0].weight.grad.abs().sum() > 0


def marker_task(batch=16, seed=0):
    """A fixed task where top-k membership is a per-token property: dimension 0 is +3 on a random
    half of each sequence and -3 on the rest, and the router scores dimension 0."""
    c, cfg = build(seed=seed)
    g = torch.Generator().manual_seed(seed)
    T = cfg.model.seq_len
    hidden, side = make_inputs(cfg, batch=batch, seed=seed)
    member = torch.stack([torch.randperm(T, generator=g) < T // 2 for _ in range(batch)])  # (B, T)
    hidden[..., 0] = torch.where(member, 3.0, -3.0)
    with torch.no_grad():
        c.block.score.weight.zero_()
        c.block.score.weight[0, 0] = 1.0
        c.block.score.bias.zero_()
    return c, cfg, hidden, side, member


def test_predictor_learns_top_k_membership_and_decides_in_eval():
    c, cfg, hidden, side, member = marker_task()
    opt = torch.optim.Adam(c.block.predictor.parameters(), lr=1e-2)
    losses = []
    for _ in range(50):
        out = c(hidden, side, None, 1.0, None)
        assert torch.equal(out.attn.hard[..., 0] == FULL, member)  # top-k = the marked half
        opt.zero_grad()
        out.extra_loss.backward()
        opt.step()
        losses.append(out.extra_loss.item())
    assert losses[-1] < 0.2 * losses[0]
    c.eval()
    decided = c(hidden, side, None, 1.0, None).attn.hard[..., 0] == FULL
    assert (decided == member).float().mean() > 0.95


def test_eval_decisions_are_causal_and_equal_the_predictor_threshold():
    c, cfg = build()
    c.eval()
    hidden, side = make_inputs(cfg)
    out = c(hidden, side, None, 1.0, None)
    with torch.no_grad():
        x = c.block.norm(hidden.float())
        p = torch.sigmoid(c.block.predictor(torch.cat([x, side], -1)).squeeze(-1))
    assert torch.equal(out.attn.hard[..., 0] == FULL, p > 0.5)
    assert torch.equal(out.experts.index[..., 0] == 0, p > 0.5)
    assert out.extra_loss is None
    # Perturb every token after t0: decisions up to t0 are bit-identical.
    t0 = 5
    hidden2, side2 = hidden.clone(), side.clone()
    hidden2[:, t0 + 1 :] = torch.randn_like(hidden2[:, t0 + 1 :]) * 5
    side2[:, t0 + 1 :] = torch.randn_like(side2[:, t0 + 1 :])
    out2 = c(hidden2, side2, None, 1.0, None)
    for a, b in ((out.attn.y, out2.attn.y), (out.attn.hard, out2.attn.hard), (out.experts.index, out2.experts.index),
                 (out.experts.weight, out2.experts.weight), (out.expert_logits, out2.expert_logits)):
        assert torch.equal(a[:, : t0 + 1], b[:, : t0 + 1])
    assert not torch.equal(out.expert_logits[:, t0 + 1 :], out2.expert_logits[:, t0 + 1 :])


def test_training_decisions_are_not_causal_which_is_why_eval_uses_the_predictor():
    c, cfg = build()
    hidden, side = make_inputs(cfg)
    out = c(hidden, side, None, 1.0, None)
    hidden2 = hidden.clone()
    hidden2[:, -1] = hidden[:, -1] + 50 * c.block.score.weight.detach()[0]  # last token now outranks all
    out2 = c(hidden2, side, None, 1.0, None)
    assert not torch.equal(out.attn.hard[:, :-1], out2.attn.hard[:, :-1])


def test_ties_in_router_score_break_toward_the_lower_position():
    c, cfg = build()
    hidden, side = make_inputs(cfg)
    hidden[:] = hidden[:, :1]  # every token identical -> every score equal
    out = c(hidden, side, None, 1.0, None)
    k = capacity_tokens(0.5, cfg.model.seq_len)
    assert (out.attn.hard[..., 0] == FULL).tolist() == [[t < k for t in range(cfg.model.seq_len)]] * 2


def test_capacity_knob_sets_the_number_of_processed_tokens():
    c, cfg = build(mod_capacity=0.25)
    out = c(*make_inputs(cfg), None, 1.0, None)
    assert (out.attn.hard[..., 0] == FULL).sum(-1).tolist() == [3, 3]


def test_cost_and_balancing_losses_read_the_mod_output():
    c, cfg = build()
    out = c(*make_inputs(cfg), None, 1.0, None)
    T, m = cfg.model.seq_len, cfg.model
    pos = torch.arange(T)
    processed = (out.attn.hard[..., 0] == FULL).double()
    hard = noise_free_cost(out, pos, m, cfg.router)
    dense = dense_cost(pos, m)
    # A processed token costs exactly the dense layer (full attention + one expert of width d_ff).
    assert torch.equal(hard.flops, processed * dense.flops)
    assert torch.equal(hard.kv_bits, dense.mem.expand(2, T))  # skipping does not save cache
    relaxed = expected_cost(out, pos, m, cfg.router)
    assert torch.allclose(relaxed.flops, hard.flops) and torch.allclose(relaxed.mem, hard.kv_bits)
    aux, terms = router_aux_loss(out, cfg.losses)
    assert math.isfinite(aux.item()) and not aux.requires_grad  # MoD has no balancing loss
    assert set(terms) == {"experts/load", "experts/z", "experts/entropy_floor", "experts/marginal_entropy"}


def test_mod_refuses_configs_it_cannot_execute():
    cfg = tiny_config()  # E = 4 experts with a null: not MoD's single dense expert
    cfg.router.kind = "mod"
    with pytest.raises(ConfigError, match=r"router.num_experts=4.*system_config\('mod', base\)"):
        build_controller(cfg, 0)
    cfg = system_config("mod", tiny_config())
    cfg.router.mod_capacity = 1.5
    with pytest.raises(ConfigError, match=r"router.mod_capacity=1.5"):
        build_controller(cfg, 0)
    assert MoDConfig.from_router(system_config("mod", tiny_config()).router) == MoDConfig()
