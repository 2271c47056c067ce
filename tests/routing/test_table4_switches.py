"""Every Table 4 switch changes the computation: each test tells the variant from the default."""

import torch

from megatron_triroute import TriRouteController
from megatron_triroute.routing.losses import router_aux_loss
from megatron_triroute.routing.noise import NoiseKey
from megatron_triroute.routing.reinforce import RewardBaseline
from megatron_triroute.routing.running_stats import commit_running_statistics
from tests.oracles import reinforce_loss

from .helpers import make_inputs, tiny_config


def build(layer=0, seed=0, **overrides):
    cfg = tiny_config(**overrides)
    torch.manual_seed(seed)
    return TriRouteController(cfg, layer).train(), cfg


def run(c, cfg, prev=None, step=0, layer=0):
    hidden, side = make_inputs(cfg)
    key = NoiseKey(5, step, layer, torch.arange(2), torch.arange(cfg.model.seq_len))
    return c(hidden, side, key, tau=1.0, prev=prev)


def test_token_level_attention_gives_every_head_the_same_mode():
    c, cfg = build(attn_granularity="token")
    out = run(c, cfg)
    assert out.attn.logits.shape[2] == 1
    assert torch.equal(out.attn.y, out.attn.y[:, :, :1].expand_as(out.attn.y))
    default = run(*build())
    assert not torch.equal(default.attn.y, default.attn.y[:, :, :1].expand_as(default.attn.y))


def test_layer_group_attention_is_decided_by_the_group_leader():
    leader, cfg = build(layer=0, attn_granularity="layer_group", layer_group_size=2)
    follower, _ = build(layer=1, attn_granularity="layer_group", layer_group_size=2)
    assert "attn" not in follower.sizes and "attn" in leader.sizes
    first = run(leader, cfg)
    second = run(follower, cfg, prev=first, layer=1)
    assert second.attn.y is first.attn.y  # reused, gradient flows back to the leader's head
    second.attn.y.sum().backward()
    assert leader.heads["attn"].proj.weight.grad is not None


def test_three_separate_routers_have_independent_trunks():
    c, cfg = build(sharing="separate")
    assert set(c.trunks) == {"attn", "experts", "bits"}
    out = run(c, cfg)
    out.bits.y.mul(torch.randn_like(out.bits.y)).sum().backward()
    assert c.trunks["bits"].fc1.weight.grad.abs().sum() > 0
    assert c.trunks["attn"].fc1.weight.grad is None  # no cross-talk through a shared trunk
    shared, _ = build()
    out = run(shared, cfg)
    out.bits.y.mul(torch.randn_like(out.bits.y)).sum().backward()
    assert shared.trunk.fc1.weight.grad.abs().sum() > 0  # the shared trunk hears every head


def test_single_shared_head_reuses_one_logit_vector():
    c, cfg = build(sharing="single_head")
    out = run(c, cfg)
    # Bits read the first 4 entries of the same vector the experts read the first 5 of.
    assert torch.equal(out.bits.logits, out.expert_logits[..., :4])
    assert torch.equal(out.attn.logits.reshape(2, 12, -1)[..., :4], out.bits.logits)


def test_without_gradient_balance_head_gradients_are_not_rescaled():
    grads = {}
    for flag in (True, False):
        c, cfg = build(grad_balance=flag)
        for step in range(2):
            out = run(c, cfg, step=step)
            (out.attn.y * torch.linspace(-1, 1, out.attn.y.numel()).view_as(out.attn.y)).sum().backward()
            commit_running_statistics([c])
        grads[flag] = c.heads["attn"].proj.weight.grad.clone()
    assert not torch.allclose(grads[True], grads[False])


def test_without_whitening_logits_ignore_running_statistics():
    outs = {}
    for flag in (True, False):
        c, cfg = build(whitening=flag)
        run(c, cfg)
        commit_running_statistics([c])
        outs[flag] = run(c, cfg, step=1)
    assert not torch.allclose(outs[True].expert_logits, outs[False].expert_logits)
    c, _ = build(whitening=False)
    assert not any(isinstance(p, torch.Tensor) and "whiten" in n for n, p in c.named_buffers())


def test_entropy_floor_switch_changes_the_auxiliary_loss_near_collapse():
    on, cfg_on = build()
    off, cfg_off = build()
    cfg_off.losses.use_entropy_floor = False
    with torch.no_grad():
        for c in (on, off):
            c.heads["bits"].bias.copy_(torch.tensor([20.0, 0, 0, 0]))  # collapse the bit axis
    loss_on, terms_on = router_aux_loss(run(on, cfg_on), cfg_on.losses)
    loss_off, terms_off = router_aux_loss(run(off, cfg_off), cfg_off.losses)
    assert terms_on["bits/entropy_floor"] > 0 and terms_off["bits/entropy_floor"] == 0
    assert loss_on > loss_off


def test_reinforce_has_no_straight_through_path_and_learns_from_reward():
    c, cfg = build(estimator="reinforce")
    out = run(c, cfg)
    assert not out.attn.y.requires_grad and out.attn.log_prob is not None
    token_loss = torch.rand(2, cfg.model.seq_len)
    reinforce_loss([out], token_loss, RewardBaseline()).backward()
    assert c.heads["attn"].proj.weight.grad.abs().sum() > 0
    st = run(*build())
    assert st.attn.y.requires_grad and st.attn.log_prob is None


def test_reinforce_baseline_commits_the_scalar_ema_without_reading_the_host():
    """The baseline's once-a-step update: the first step with rewards sets the mean, later ones
    the EMA, a step without rewards changes nothing; bit for bit the float64 scalar formula, and no
    value read back (no sync on a GPU)."""
    from .test_controller import _HostReads

    steps = [(0.0, 0.0), (3.3, 7.0), (0.0, 0.0), (-1.7, 3.0), (2.123456789, 11.0)]
    baseline, value, seen, reads = RewardBaseline(momentum=0.9), 0.0, 0, _HostReads()
    for total, count in steps:
        baseline.accumulate(torch.tensor(total, dtype=torch.float64), count)
        with reads:
            baseline.commit(baseline.pending())  # pending() is the accumulator itself: read before zeroed
        if count > 0:
            value = total / count if seen == 0 else 0.9 * value + (1 - 0.9) * (total / count)
            seen += 1
        assert baseline.value.item() == value and baseline.steps.item() == seen
        assert baseline.pending().tolist() == [0.0, 0.0]
    assert reads.reads == []


def test_no_null_expert_never_skips_the_ffn():
    c, cfg = build(null_expert=False)
    out = run(c, cfg)
    assert out.expert_logits.shape[-1] == cfg.router.num_experts
    assert (out.experts.index >= 0).all()
    with torch.no_grad():
        d, _ = build()
        d.heads["experts"].bias.copy_(torch.tensor([20.0, 0, 0, 0, 0]))
    assert (run(d, cfg).experts.index == -1).any()


def test_uniform_bits_builds_no_bit_head_and_writes_one_width():
    c, cfg = build(bit_routing=False, uniform_bits=8)
    assert "bits" not in c.sizes
    out = run(c, cfg)
    assert out.bits.logits is None and out.bits.y.shape[-1] == 1
    assert torch.equal(out.bits.hard, torch.zeros(2, cfg.model.seq_len, dtype=torch.long))
