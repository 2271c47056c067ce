"""Named systems and ablation variants: each builds, trains a step in a tiny pure-PyTorch stack,
and differs from the default TriRoute in the specific way its name says."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron_triroute import systems
from megatron_triroute.config import ConfigError, TriRouteConfig
from megatron_triroute.routing.modes import ATTN_MODES
from megatron_triroute.routing.controller import TriRouteController, decision_features
from megatron_triroute.routing.cost import dense_cost, expected_cost, expert_width, noise_free_cost
from megatron_triroute.routing.factory import build_controller
from megatron_triroute.routing.independent import IndependentController
from megatron_triroute.routing.losses import router_aux_loss
from megatron_triroute.routing.mod import MoDController
from megatron_triroute.routing.noise import NoiseKey
from megatron_triroute.routing.quant import kv_bits_per_token, relaxed_kv_write
from tests.oracles import combine_experts, reference_attention, swiglu
from megatron_triroute.routing.side_features import TokenTables, static_side_features

from .routing.helpers import tiny_config

SKIP, FULL = ATTN_MODES.index("skip"), ATTN_MODES.index("full")
B = 2


class TinyStack(nn.Module):
    """A two-layer LM whose controllers come from `build_controller` (any router family)."""

    def __init__(self, cfg: TriRouteConfig):
        super().__init__()
        m, r = cfg.model, cfg.router
        self.cfg = cfg
        self.embed = nn.Embedding(m.vocab_size, m.d_model)
        self.controllers = nn.ModuleList(build_controller(cfg, i) for i in range(m.n_layers))
        self.qkv = nn.ModuleList(nn.Linear(m.d_model, m.d_model + 2 * m.d_kv, bias=False) for _ in range(m.n_layers))
        self.proj = nn.ModuleList(nn.Linear(m.d_model, m.d_model, bias=False) for _ in range(m.n_layers))
        n_ffn, d_e = (r.num_experts, expert_width(m, r)) if r.expert_routing else (1, m.d_ff)
        self.w13 = nn.Parameter(torch.randn(m.n_layers, n_ffn, 2, m.d_model, d_e) * 0.1)
        self.w2 = nn.Parameter(torch.randn(m.n_layers, n_ffn, d_e, m.d_model) * 0.1)
        self.head = nn.Linear(m.d_model, m.vocab_size, bias=False)

    def forward(self, tokens):
        m, r = self.cfg.model, self.cfg.router
        T = tokens.shape[1]
        x = self.embed(tokens)
        static = static_side_features(tokens, TokenTables.uniform(m.vocab_size), r.max_doc_position)
        widths = r.bits if r.bit_routing else (r.uniform_bits,)
        prev, outs = None, []
        for layer, controller in enumerate(self.controllers):
            side = torch.cat([static, decision_features(prev, B, T, len(r.bits), r.top_k)], -1)
            key = NoiseKey(self.cfg.seed, 0, layer, torch.arange(B), torch.arange(T))
            out = controller(x, side, key, 1.0, prev)
            q, k, v = self.qkv[layer](F.rms_norm(x, (m.d_model,))).split([m.d_model, m.d_kv, m.d_kv], -1)
            q = q.view(B, T, m.n_heads, m.d_head)
            k, v = (relaxed_kv_write(t.view(B, T, m.n_kv_heads, m.d_head), out.bits.y, widths, r.group_size_for(m))
                    for t in (k, v))
            x = x + self.proj[layer](reference_attention(q, k, v, out.attn.y, r.window).reshape(B, T, m.d_model))
            h = F.rms_norm(x, (m.d_model,)).reshape(B * T, m.d_model)
            ffns = [swiglu(w[0], w[1], w2) for w, w2 in zip(self.w13[layer], self.w2[layer])]
            if out.experts is None:
                ffn = ffns[0](h)
            else:
                ffn = combine_experts(h, out.experts.index.reshape(B * T, -1), out.experts.weight.reshape(B * T, -1), ffns)
            x = x + ffn.view(B, T, m.d_model)
            prev = out
            outs.append(out)
        return self.head(x), outs


def train_step(cfg: TriRouteConfig, seed: int = 0):
    """One forward + backward of the tiny stack: LM loss, balancing losses, the family's extra
    loss, and (budget on) the cost surrogate priced at lambda = 1."""
    torch.manual_seed(seed)
    model = TinyStack(cfg).train()
    tokens = torch.randint(0, cfg.model.vocab_size, (B, cfg.model.seq_len), generator=torch.Generator().manual_seed(1))
    logits, outs = model(tokens)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    pos = torch.arange(cfg.model.seq_len)
    dense = dense_cost(pos, cfg.model)
    for out in outs:
        loss = loss + router_aux_loss(out, cfg.losses)[0]
        if out.extra_loss is not None:
            loss = loss + out.extra_loss
        if cfg.budget.enabled:
            cost = expected_cost(out, pos, cfg.model, cfg.router)
            loss = loss + (cost.flops.sum() / (dense.flops.sum() * B) + cost.mem.sum() / (dense.mem.sum() * B)).float()
    loss.backward()
    assert math.isfinite(loss.item())
    return model, outs


def n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def routed_grad(model: TinyStack) -> bool:
    return any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.controllers.parameters())


def hard_costs(cfg, outs):
    pos = torch.arange(cfg.model.seq_len)
    return [noise_free_cost(o, pos, cfg.model, cfg.router) for o in outs]


@pytest.fixture(scope="module")
def base():
    return tiny_config()


@pytest.fixture(scope="module")
def default(base):
    cfg = systems.system_config("triroute", base)
    model, outs = train_step(cfg)
    return cfg, model, outs


# --- every name ---------------------------------------------------------------------------------
def test_list_presets_is_systems_then_variants():
    assert systems.list_presets() == systems.SYSTEMS + systems.VARIANTS
    assert len(systems.SYSTEMS) == 6 and len(systems.VARIANTS) == 10


@pytest.mark.parametrize("name", ["nope", "MoE", ""])
def test_unknown_names_raise_with_the_valid_names(base, name):
    for call in (lambda: systems.system_config(name, base), lambda: systems.knobs(name), lambda: systems.describe(name)):
        with pytest.raises(ConfigError) as err:
            call()
        for valid in systems.list_presets():
            assert valid in str(err.value)


@pytest.mark.parametrize("name", systems.SYSTEMS + systems.VARIANTS)
def test_every_preset_builds_validates_and_trains_a_step(base, name):
    before = base.to_dict()
    cfg = systems.system_config(name, base)
    assert base.to_dict() == before  # a deep copy: the base is untouched
    assert TriRouteConfig.from_dict(cfg.to_dict()).validate() == cfg  # serialisable and valid
    model, outs = train_step(cfg)
    assert len(outs) == cfg.model.n_layers
    assert model.embed.weight.grad.abs().sum() > 0
    assert routed_grad(model) == (name not in ("dense", "kvquant"))  # every system with a router trains it
    assert systems.describe(name)


# --- the six systems, each against the default TriRoute -----------------------------------------
def test_triroute_is_the_base_with_all_three_axes(base, default):
    cfg, model, outs = default
    assert cfg == base
    c = model.controllers[0]
    assert isinstance(c, TriRouteController) and set(c.sizes) == {"attn", "experts", "bits"}
    assert all(o.attn.logits is not None and o.bits.logits is not None for o in outs)
    # Per-head attention with a null expert and routed bits: decisions vary across heads.
    assert any(not torch.equal(o.attn.hard, o.attn.hard[..., :1].expand_as(o.attn.hard)) for o in outs)


def test_dense_routes_nothing_and_costs_exactly_the_dense_model(base, default):
    cfg = systems.system_config("dense", base)
    model, outs = train_step(cfg)
    pos = torch.arange(cfg.model.seq_len)
    dense = dense_cost(pos, cfg.model)
    assert all(c.sizes == {} for c in model.controllers) and not cfg.budget.enabled
    assert n_params(model.controllers) < n_params(default[1].controllers)
    for out, hard in zip(outs, hard_costs(cfg, outs)):
        assert out.experts is None and (out.attn.hard == FULL).all()
        assert torch.equal(hard.flops, dense.flops.expand(B, -1)) and torch.equal(hard.kv_bits, dense.mem.expand(B, -1))


def test_mod_gates_whole_blocks_at_its_capacity_and_keeps_the_16_bit_cache(base, default):
    cfg = systems.system_config("mod", base)
    model, outs = train_step(cfg)
    assert all(isinstance(c, MoDController) for c in model.controllers)
    assert (cfg.router.num_experts, cfg.router.top_k, cfg.router.null_expert) == (1, 1, True)
    assert expert_width(cfg.model, cfg.router) == cfg.model.d_ff and not cfg.budget.enabled
    dense = dense_cost(torch.arange(cfg.model.seq_len), cfg.model)
    for out, hard in zip(outs, hard_costs(cfg, outs)):
        assert torch.equal(out.attn.hard, out.attn.hard[..., :1].expand_as(out.attn.hard))  # one mode per token
        processed = out.attn.hard[..., 0] == FULL
        assert processed.sum(-1).tolist() == [cfg.model.seq_len // 2] * B
        assert torch.equal(out.experts.index[..., 0] == 0, processed)
        assert torch.equal(hard.flops, processed * dense.flops)  # processed = dense layer, skipped = 0
        assert torch.equal(hard.kv_bits, dense.mem.expand(B, -1))
    assert model.controllers[0].block.score.weight.grad.abs().sum() > 0
    assert systems.knobs("mod", base)[0].path == "router.mod_capacity"


def test_moe_routes_only_experts_without_a_null_at_pinned_width(base, default):
    cfg = systems.system_config("moe", base)
    model, outs = train_step(cfg)
    assert all(c.sizes == {"experts": cfg.router.num_experts} for c in model.controllers)
    assert default[1].controllers[0].sizes["experts"] == cfg.router.num_experts + 1  # TriRoute has the null
    assert cfg.model.expert_d_ff == expert_width(base.model, base.router)
    dense = dense_cost(torch.arange(cfg.model.seq_len), cfg.model)
    for out, hard in zip(outs, hard_costs(cfg, outs)):
        assert (out.experts.index >= 0).all() and (out.attn.hard == FULL).all()
        assert (hard.experts_run == cfg.router.top_k).all()
        assert torch.equal(hard.kv_bits, dense.mem.expand(B, -1))
    # Its knob trades FLOPs at fixed experts: top-1 runs half the expert MACs of top-2.
    k1 = systems.system_config("moe", base)
    k1.router.top_k = 1
    k1.validate()
    _, outs1 = train_step(k1)
    assert torch.equal(2 * hard_costs(k1, outs1)[0].expert_macs, hard_costs(cfg, outs)[0].expert_macs)


def test_kvquant_is_dense_compute_with_a_uniform_4_bit_cache(base):
    cfg = systems.system_config("kvquant", base)
    model, outs = train_step(cfg)
    m = cfg.model
    assert cfg.router.uniform_bits == systems.DEFAULT_KV_BITS == 4 and all(c.sizes == {} for c in model.controllers)
    dense = dense_cost(torch.arange(m.seq_len), m)
    expected = kv_bits_per_token(4, m.d_kv, cfg.router.group_size_for(m))
    for out, hard in zip(outs, hard_costs(cfg, outs)):
        assert out.experts is None
        assert torch.equal(hard.flops, dense.flops.expand(B, -1))
        assert (hard.kv_bits == expected).all() and expected < dense.mem[0]
    reduced = base.__class__.from_dict(base.to_dict())
    reduced.router.uniform_bits = 8
    assert systems.system_config("kvquant", reduced).router.uniform_bits == 8  # the base's width wins


def test_independent_has_separate_routers_and_three_knobs(base, default):
    cfg = systems.system_config("independent", base)
    model, outs = train_step(cfg)
    c = model.controllers[0]
    assert isinstance(c, IndependentController)
    assert not {id(p) for p in c.block.parameters()} & {id(p) for p in c.moe_router.parameters()}
    assert cfg.router.uniform_bits == 4 and not cfg.router.null_expert
    for out in outs:
        skipped = out.attn.hard[..., 0] == SKIP
        assert (out.experts.index[skipped] == -1).all() and (out.experts.index[~skipped] >= 0).all()
        assert out.bits.logits is None and out.attn.logits is None
    assert [k.path for k in systems.knobs("independent", base)] == [
        "router.mod_capacity", "router.top_k", "router.uniform_bits"]


def test_knobs_describe_each_systems_sweep(base):
    assert systems.knobs("dense", base) == ()
    (top_k,) = systems.knobs("moe", base)
    assert top_k.choices == tuple(range(1, base.router.num_experts + 1)) and top_k.resource == "flops"
    (width,) = systems.knobs("kvquant", base)
    assert width.choices == (2, 4, 8) and width.default == 4 and width.resource == "mem"
    (capacity,) = systems.knobs("mod", base)
    assert capacity.bounds == (0.0, 1.0) and capacity.default == 0.5
    for name in ("triroute",) + systems.VARIANTS:
        assert [k.path for k in systems.knobs(name, base)] == ["budget.flops_target", "budget.mem_target"]


def test_baselines_use_the_single_axis_recipe_and_no_budget(base):
    for name in ("dense", "mod", "moe", "kvquant", "independent"):
        cfg = systems.system_config(name, base)
        assert not cfg.budget.enabled and not cfg.router.bit_routing
        assert not (cfg.router.whitening or cfg.router.grad_balance or cfg.losses.use_entropy_floor)
    assert systems.system_config("triroute", base).budget.enabled


# --- Table "Ablations" variants: one switch each --------------------------------------------------
def variant(base, name):
    cfg = systems.system_config(name, base)
    diff = {k: v for k, v in _flat(cfg.to_dict()).items() if _flat(base.to_dict())[k] != v}
    return cfg, diff, train_step(cfg)


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def test_token_attention_variant_has_one_attention_logit_group(base, default):
    cfg, diff, (model, outs) = variant(base, "token_attention")
    assert diff == {"router.attn_granularity": "token"}
    assert outs[0].attn.logits.shape[2] == 1 and default[2][0].attn.logits.shape[2] == cfg.model.n_heads
    assert n_params(model.controllers) < n_params(default[1].controllers)


def test_layer_group_variant_reuses_the_leaders_attention(base, default):
    cfg, diff, (model, outs) = variant(base, "layer_group_attention")
    assert diff == {"router.attn_granularity": "layer_group"}
    assert "attn" in model.controllers[0].sizes and "attn" not in model.controllers[1].sizes
    assert outs[1].attn.y is outs[0].attn.y and default[2][1].attn.y is not default[2][0].attn.y


def test_separate_routers_variant_has_three_trunks(base, default):
    cfg, diff, (model, _) = variant(base, "separate_routers")
    assert diff == {"router.sharing": "separate"}
    assert set(model.controllers[0].trunks) == {"attn", "experts", "bits"}
    assert n_params(model.controllers) > n_params(default[1].controllers)


def test_single_head_variant_reads_every_axis_from_one_logit_vector(base, default):
    cfg, diff, (model, outs) = variant(base, "single_head")
    assert diff == {"router.sharing": "single_head"}
    o = outs[0]
    assert torch.equal(o.bits.logits, o.expert_logits[..., : len(cfg.router.bits)])
    d = default[2][0]
    assert not torch.equal(d.bits.logits, d.expert_logits[..., : len(cfg.router.bits)])


def test_no_grad_balance_variant_disables_every_balance(base, default):
    cfg, diff, (model, _) = variant(base, "no_grad_balance")
    assert diff == {"router.grad_balance": False}
    assert all(not b.enabled for c in model.controllers for b in c.balance.values())
    assert all(b.enabled for c in default[1].controllers for b in c.balance.values())


def test_no_whitening_variant_has_plain_linear_heads(base, default):
    cfg, diff, (model, _) = variant(base, "no_whitening")
    assert diff == {"router.whitening": False}
    assert all(h.whiten is None and h.gain is None for c in model.controllers for h in c.heads.values())
    assert n_params(model.controllers) < n_params(default[1].controllers)


def test_no_entropy_floor_variant_drops_the_hinge_on_a_collapsed_axis(base):
    for name, active in (("triroute", True), ("no_entropy_floor", False)):
        cfg = systems.system_config(name, base)
        torch.manual_seed(0)
        c = build_controller(cfg, 0).train()
        with torch.no_grad():
            c.heads["bits"].bias.copy_(torch.tensor([20.0, 0.0, 0.0, 0.0]))  # bit axis collapsed on 2 bits
        hidden = torch.randn(B, cfg.model.seq_len, cfg.model.d_model)
        side = torch.randn(B, cfg.model.seq_len, 3 + 4 + len(cfg.router.bits))
        _, terms = router_aux_loss(c(hidden, side, None, 1.0, None), cfg.losses)
        assert (terms["bits/entropy_floor"] > 0.1) == active
    assert variant(base, "no_entropy_floor")[1] == {"losses.use_entropy_floor": False}


def test_reinforce_variant_samples_without_a_straight_through_path(base, default):
    cfg, diff, (model, outs) = variant(base, "reinforce")
    assert diff == {"router.estimator": "reinforce"}
    assert outs[0].attn.log_prob is not None and default[2][0].attn.log_prob is None
    assert not torch.equal(outs[0].attn.y_cost, outs[0].attn.y)  # y_cost = policy probabilities


def test_no_null_expert_variant_always_runs_top_k_real_experts(base, default):
    cfg, diff, (model, outs) = variant(base, "no_null_expert")
    assert diff == {"router.null_expert": False}
    assert outs[0].expert_logits.shape[-1] == cfg.router.num_experts
    assert all((hard.experts_run == cfg.router.top_k).all() for hard in hard_costs(cfg, outs))


def test_uniform_bits_variant_writes_the_widest_width_within_the_memory_target(base, default):
    cfg, diff, (model, outs) = variant(base, "uniform_bits")
    m, r = cfg.model, cfg.router
    g = r.group_size_for(m)
    fits = [b for b in r.bits if kv_bits_per_token(b, m.d_kv, g) <= cfg.budget.mem_target * 2 * m.d_kv * 16]
    assert diff == {"router.bit_routing": False, "router.uniform_bits": max(fits) if fits else min(r.bits)}
    assert "bits" not in model.controllers[0].sizes and outs[0].bits.logits is None
    assert len({h.kv_bits.unique().item() for h in hard_costs(cfg, outs)}) == 1
    # At the default sizes 4 bits (plus scale/zero metadata) is the widest width within 0.40.
    assert systems.system_config("uniform_bits", TriRouteConfig()).router.uniform_bits == 4
