"""The six systems and the Table 4 variants inside the Megatron model.

Each preset, built by `system_config(name, tiny_triroute())`, builds a `TriRouteGPTModel`, trains
one optimizer step through `TrainEngine`, and differs from the default TriRoute in the built
model in the way its name says (parameters, controller structure, decisions captured by a
forward hook on `layer.controller`, the realised cost in the step report, gradients).

One gloo process builds every preset (a spawn costs seconds on 2 cores) and records plain facts
(numbers, names, decision tensors); the tests below assert on those facts, one test id per
preset, so a failing preset names itself.
"""

from __future__ import annotations

import traceback

import pytest
import torch

from megatron_triroute.routing.modes import ATTN_MODES
from megatron_triroute.routing.mod import capacity_tokens
from megatron_triroute.systems import SYSTEMS, VARIANTS, system_config
from tests.dist_utils import run_distributed
from tests.model.harness import batch, build, tiny_triroute

PRESETS = SYSTEMS + VARIANTS
SKIP, LOCAL, FULL = (ATTN_MODES.index(m) for m in ("skip", "local", "full"))
SEED = 3
"""Every preset is built from the same seed, so presets whose switch adds or removes no
parameter start from identical weights and see identical Gumbel noise."""
DECISION_AXES = ("attn", "bits")
"""Axes whose head learns only from the LM loss through its (straight-through or score-function)
estimator; the expert head also learns through the gate weights, whatever the estimator."""


def _has_decision_heads(name: str) -> bool:
    """A TriRoute controller with its own attention or bit head (single_head shares one head
    between all axes, so the expert gates' gradient would mix in)."""
    r = system_config(name, tiny_triroute()).router
    return r.kind == "triroute" and r.sharing != "single_head" and (r.attn_routing or r.bit_routing)


DECISION_HEAD_PRESETS = tuple(n for n in PRESETS if _has_decision_heads(n))


# --- inside the gloo process -----------------------------------------------------------------------
def _engine(model, groups, lr: float = 0.1):
    from megatron_triroute.training.engine import TrainEngine

    return TrainEngine(model, groups, torch.optim.SGD(model.parameters(), lr=lr), total_steps=10, clip_grad=0.0)


def _micro_batch(cfg, label_shift: int = 0):
    from megatron_triroute.training.engine import MicroBatch

    tokens, labels, idx = batch(cfg, n=2, seed=11)
    labels = (labels + label_shift) % cfg.model.vocab_size
    return MicroBatch(tokens, labels, torch.ones_like(tokens, dtype=torch.float), idx)


def _build(name: str):
    return build(system_config(name, tiny_triroute()), seed=SEED)


def _structure(controller) -> dict:
    """What a controller is made of: routed axes and their logit counts, trunk sharing, heads."""
    inner = getattr(controller, "moe_router", controller)  # Independent: its MoE router
    heads = getattr(inner, "heads", None) or {}
    single = getattr(inner, "shared_head", None)
    balance = getattr(inner, "balance", {})
    return {
        "class": type(controller).__name__,
        "params": sum(p.numel() for p in controller.parameters()),
        "sizes": dict(getattr(inner, "sizes", {})),
        "trunks": sorted(getattr(inner, "trunks", {}) or {}),
        "shared_trunk": hasattr(inner, "trunk"),
        "heads": sorted(heads),
        "single_head_width": None if single is None else single.proj.out_features,
        "whitened": sorted(a for a, h in heads.items() if h.whiten is not None),
        "balance_enabled": {a: bool(b.enabled) for a, b in balance.items()},
        "has_block_router": hasattr(controller, "block"),
    }


def _capture_decisions(model) -> tuple[list[dict], list]:
    captured = [dict() for _ in model.decoder.layers]

    def hook(i):
        def record(module, args, out):
            captured[i].update(
                attn_hard=out.attn.hard.detach().clone(),
                bits_hard=out.bits.hard.detach().clone(),
                expert_index=None if out.experts is None else out.experts.index.detach().clone(),
                attn_log_prob=out.attn.log_prob is not None,
                attn_y_differentiable=bool(out.attn.y.requires_grad),
            )
        return record

    handles = [layer.controller.register_forward_hook(hook(i)) for i, layer in enumerate(model.decoder.layers)]
    return captured, handles


def _preset_facts(name: str) -> dict:
    model, groups = _build(name)
    cfg = model.triroute
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    decisions, handles = _capture_decisions(model)
    report = _engine(model, groups).train_step([_micro_batch(cfg)], step=0)
    for h in handles:
        h.remove()
    changed = sorted(n for n, p in model.named_parameters() if not torch.equal(before[n], p))
    layers = model.decoder.layers
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "controllers": [_structure(layer.controller) for layer in layers],
        "mlp": [type(layer.mlp).__name__ for layer in layers],
        "controller_changed": [
            any(n.startswith(f"decoder.layers.{i}.controller.") for n in changed) for i in range(len(layers))
        ],
        "changed": len(changed),
        "loss": report.loss,
        "skipped": report.skipped,
        "realised": list(report.realised),
        "rho": [{a: float(b.rho) for a, b in getattr(l.controller, "balance", {}).items()} for l in layers],
        "whitening_moved": [
            any(not torch.equal(h.whiten.mean, torch.zeros_like(h.whiten.mean))
                for h in (getattr(l.controller, "heads", None) or {}).values() if h.whiten is not None)
            for l in layers
        ],
        "decisions": decisions,
    }


def _decision_head_grads(name: str, label_shift: int) -> torch.Tensor:
    """Gradient on the attention and bit heads after one training step (lr 0), flattened."""
    model, groups = _build(name)
    prefixes = tuple(f"heads.{a}." for a in DECISION_AXES)
    params = [p for layer in model.decoder.layers for n, p in layer.controller.named_parameters()
              if n.startswith(prefixes)]
    _engine(model, groups, lr=0.0).train_step([_micro_batch(model.triroute, label_shift)], step=0)
    return torch.cat([p.grad.flatten() for p in params])


def _collapsed_attention_grad(name: str) -> torch.Tensor:
    """Attention-head bias gradient (L, H, 3) when every head already prefers `full` by a wide
    margin, so the marginal entropy sits below the floor and the hinge is active."""
    model, groups = _build(name)
    with torch.no_grad():
        for layer in model.decoder.layers:
            layer.controller.heads["attn"].bias.view(-1, len(ATTN_MODES))[:, FULL] += 8.0
    _engine(model, groups).train_step([_micro_batch(model.triroute)], step=0)
    return torch.stack([l.controller.heads["attn"].bias.grad.view(-1, len(ATTN_MODES)) for l in model.decoder.layers])


def _guarded(fn, *args):
    from megatron_triroute.parallel import destroy_parallel

    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - recorded and reported by the test of that preset
        return {"error": traceback.format_exc()}
    finally:
        destroy_parallel()


def _collect(rank, world_size, path):
    facts = {"presets": {name: _guarded(_preset_facts, name) for name in PRESETS}}
    facts["lm_to_decision_heads"] = {
        name: [_guarded(_decision_head_grads, name, shift) for shift in (0, 1)] for name in DECISION_HEAD_PRESETS
    }
    facts["collapsed_attention_grad"] = {
        name: _guarded(_collapsed_attention_grad, name) for name in ("triroute", "no_entropy_floor")
    }
    torch.save(facts, path)


# --- in the test process ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def facts(tmp_path_factory):
    path = tmp_path_factory.mktemp("systems_megatron") / "facts.pt"
    run_distributed(_collect, 1, str(path), timeout=300)
    return torch.load(path, weights_only=True)


def _preset(facts, name) -> dict:
    f = facts["presets"][name]
    assert "error" not in f, f"{name} failed to build or train in the Megatron model:\n{f['error']}"
    return f


def _dense_bits_per_token(cfg) -> int:
    """A token's K and V in one layer at 16 bits: 2 * H_kv * d_h values."""
    return 2 * cfg.model.n_kv_heads * cfg.model.d_head * 16


def _quantised_bits_per_token(cfg, bits: int) -> int:
    """2 * d_kv values at `bits`, plus a float16 (scale, zero) pair per group of `g` channels of K
    and of V (groups never span heads, g = min(kv_group_size, d_h))."""
    d_kv = cfg.model.n_kv_heads * cfg.model.d_head
    g = min(cfg.router.kv_group_size, cfg.model.d_head)
    return 2 * d_kv * bits + 2 * (d_kv // g) * 2 * 16


def _heads_agree(attn_hard: torch.Tensor) -> bool:
    """(B, T, H): every head of every token reads in the same mode."""
    return bool((attn_hard == attn_hard[..., :1]).all())


def _trunk_params(cfg) -> int:
    """Linear(d + F -> d_r) + Linear(d_r -> d_r) + RMSNorm(d_r), F = 3 static + 3 + 1 + |bits|."""
    d, d_r = cfg.model.d_model, cfg.router.d_router
    d_in = d + 3 + 3 + 1 + len(cfg.router.bits)
    return d_in * d_r + d_r + d_r * d_r + d_r + d_r


@pytest.mark.distributed
@pytest.mark.parametrize("name", PRESETS)
def test_preset_trains_one_step(facts, name):
    f = _preset(facts, name)
    assert not f["skipped"] and torch.isfinite(torch.tensor(f["loss"])), f["loss"]
    assert f["changed"] > 0
    for i, c in enumerate(f["controllers"]):
        if c["params"]:
            assert f["controller_changed"][i], f"layer {i}: the {c['class']} did not move in one step"
    flops, mem = f["realised"]
    assert 0.0 < flops <= 1.0 and 0.0 < mem <= 1.0, f["realised"]


def _check_triroute(f, base, cfg):
    H, E = cfg.model.n_heads, cfg.router.num_experts
    for c in f["controllers"]:
        assert c["class"] == "TriRouteController" and c["shared_trunk"]
        assert c["sizes"] == {"attn": 3 * H, "experts": E + 1, "bits": len(cfg.router.bits)}
        assert c["whitened"] == ["attn", "bits", "experts"]
    assert set(f["mlp"]) == {"RoutedExperts"}
    # per-head modes: some token has heads in different modes
    assert any(not _heads_agree(d["attn_hard"]) for d in f["decisions"])


def _check_dense(f, base, cfg):
    assert all(c["params"] == 0 and c["sizes"] == {} for c in f["controllers"])
    assert set(f["mlp"]) == {"DenseFFN"}
    assert f["realised"] == [1.0, 1.0]
    assert f["params"] < base["params"]
    assert all(bool((d["attn_hard"] == FULL).all()) and d["expert_index"] is None for d in f["decisions"])


def _check_mod(f, base, cfg):
    k = capacity_tokens(cfg.router.mod_capacity, cfg.model.seq_len)
    for c, d in zip(f["controllers"], f["decisions"]):
        assert c["class"] == "MoDController" and c["has_block_router"]
        a = d["attn_hard"]
        assert _heads_agree(a) and bool(((a == FULL) | (a == SKIP)).all())
        processed = a[..., 0] == FULL  # (B, T)
        assert processed.sum(-1).tolist() == [k] * a.shape[0]  # top-k tokens per sequence
        # processed -> the one dense expert (0); skipped -> null (-1)
        assert torch.equal(d["expert_index"][..., 0], torch.where(processed, 0, -1))
    flops, mem = f["realised"]
    assert flops < 1.0 and mem == 1.0  # MoD skips compute, never the cache write


def _check_moe(f, base, cfg):
    for c, d in zip(f["controllers"], f["decisions"]):
        assert c["sizes"] == {"experts": cfg.router.num_experts}  # no null option, no attn/bits head
        assert bool((d["attn_hard"] == FULL).all())
        assert bool((d["expert_index"] >= 0).all()) and d["expert_index"].shape[-1] == cfg.router.top_k
    # top-k experts of width d_ff / k: the same active FFN MACs as the dense FFN
    assert f["realised"] == [1.0, 1.0]


def _check_kvquant(f, base, cfg):
    assert all(c["params"] == 0 for c in f["controllers"]) and set(f["mlp"]) == {"DenseFFN"}
    bits = cfg.router.uniform_bits
    assert bits < 16
    assert f["realised"] == [1.0, _quantised_bits_per_token(cfg, bits) / _dense_bits_per_token(cfg)]


def _check_independent(f, base, cfg):
    k = capacity_tokens(cfg.router.mod_capacity, cfg.model.seq_len)
    for c, d in zip(f["controllers"], f["decisions"]):
        assert c["class"] == "IndependentController" and c["has_block_router"]
        assert c["sizes"] == {"experts": cfg.router.num_experts}  # its own MoE router, no null
        processed = d["attn_hard"][..., 0] == FULL
        assert _heads_agree(d["attn_hard"]) and processed.sum(-1).tolist() == [k] * processed.shape[0]
        idx = d["expert_index"]
        assert bool((idx[processed] >= 0).all()) and bool((idx[~processed] == -1).all())
    flops, mem = f["realised"]
    assert flops < 1.0
    assert mem == _quantised_bits_per_token(cfg, cfg.router.uniform_bits) / _dense_bits_per_token(cfg)


def _check_token_attention(f, base, cfg):
    assert all(c["sizes"]["attn"] == 3 for c in f["controllers"])  # one mode per token, not per head
    assert f["params"] < base["params"]
    assert all(_heads_agree(d["attn_hard"]) for d in f["decisions"])


def _check_layer_group_attention(f, base, cfg):
    g = cfg.router.layer_group_size
    leaders = [i for i in range(cfg.model.n_layers) if i % g == 0]
    assert len(leaders) < cfg.model.n_layers, "the tiny model must have a follower layer"
    for i, (c, d) in enumerate(zip(f["controllers"], f["decisions"])):
        assert ("attn" in c["sizes"]) == (i in leaders), (i, c["sizes"])
        assert _heads_agree(d["attn_hard"])
        leader = f["decisions"][i - i % g]["attn_hard"]
        assert torch.equal(d["attn_hard"], leader), f"layer {i} does not reuse its group leader's modes"


def _check_separate_routers(f, base, cfg):
    extra = 2 * _trunk_params(cfg)  # three trunks instead of one
    for c, b in zip(f["controllers"], base["controllers"]):
        assert c["trunks"] == ["attn", "bits", "experts"] and not c["shared_trunk"]
        assert c["params"] - b["params"] == extra


def _check_single_head(f, base, cfg):
    d_r = cfg.router.d_router
    for c, b in zip(f["controllers"], base["controllers"]):
        assert c["heads"] == [] and c["single_head_width"] == max(b["sizes"].values())
        # three heads (proj + gain + bias each) -> one of the widest width
        three = sum(d_r * n + 2 * n for n in b["sizes"].values())
        one = d_r * c["single_head_width"] + 2 * c["single_head_width"]
        assert b["params"] - c["params"] == three - one


def _check_no_grad_balance(f, base, cfg):
    assert f["loss"] == base["loss"]  # identical forward: the switch acts in backward only
    assert all(not any(c["balance_enabled"].values()) for c in f["controllers"])
    assert all(set(r.values()) == {1.0} for r in f["rho"])  # rho never moves
    assert all(any(v != 1.0 for v in r.values()) for r in base["rho"])  # the default's does


def _check_no_whitening(f, base, cfg):
    for c, b in zip(f["controllers"], base["controllers"]):
        assert c["whitened"] == [] and b["params"] - c["params"] == sum(b["sizes"].values())  # no gains
    assert not any(f["whitening_moved"]) and all(base["whitening_moved"])


def _check_no_entropy_floor(f, base, cfg, collapsed):
    assert f["loss"] == base["loss"]  # the hinge is inactive at init: same forward, same step
    diff = collapsed["triroute"] - collapsed["no_entropy_floor"]  # (L, H, 3): the hinge's gradient
    # With `full` dominating, the floor pushes `full` down and the other modes up (descent on +grad).
    assert bool((diff[..., FULL] > 0).all()) and bool((diff[..., [SKIP, LOCAL]] < 0).all()), diff


def _check_reinforce(f, base, cfg):
    # Under the same noise the Gumbel-max sample equals the ST sample's forward value.
    assert abs(f["loss"] - base["loss"]) < 1e-6
    for d, b in zip(f["decisions"], base["decisions"]):
        assert d["attn_log_prob"] and not d["attn_y_differentiable"]  # score function, no ST path
        assert not b["attn_log_prob"] and b["attn_y_differentiable"]


def _check_no_null_expert(f, base, cfg):
    for c, d in zip(f["controllers"], f["decisions"]):
        assert c["sizes"]["experts"] == cfg.router.num_experts
        assert bool((d["expert_index"] >= 0).all())  # every slot runs a real expert
    assert all(b["sizes"]["experts"] == cfg.router.num_experts + 1 for b in base["controllers"])


def _check_uniform_bits(f, base, cfg):
    assert all("bits" not in c["sizes"] for c in f["controllers"])
    bits = cfg.router.uniform_bits
    mem = _quantised_bits_per_token(cfg, bits) / _dense_bits_per_token(cfg)
    assert f["realised"][1] == mem <= cfg.budget.mem_target
    wider = [b for b in cfg.router.bits if b > bits]
    assert all(_quantised_bits_per_token(cfg, b) / _dense_bits_per_token(cfg) > cfg.budget.mem_target for b in wider)


CHECKS = {name: globals()[f"_check_{name}"] for name in PRESETS}


@pytest.mark.distributed
@pytest.mark.parametrize("name", PRESETS)
def test_preset_differs_from_triroute_as_named(facts, name):
    base = _preset(facts, "triroute")
    f = _preset(facts, name)
    cfg = system_config(name, tiny_triroute())
    if name == "no_entropy_floor":
        collapsed = facts["collapsed_attention_grad"]
        for v in collapsed.values():
            assert not isinstance(v, dict), v["error"]
        CHECKS[name](f, base, cfg, collapsed)
    else:
        CHECKS[name](f, base, cfg)


@pytest.mark.distributed
@pytest.mark.parametrize("name", DECISION_HEAD_PRESETS)
def test_decision_heads_learn_from_the_lm_loss(facts, name):
    """Same tokens, noise and weights, different targets: the decisions, balancing losses and
    budget term are unchanged, so any change in the attention/bit heads' gradient comes from the
    LM loss (through the straight-through sample, or REINFORCE's reward)."""
    grads = facts["lm_to_decision_heads"][name]
    for g in grads:
        assert not isinstance(g, dict), g["error"]
    assert not torch.allclose(grads[0], grads[1], rtol=0, atol=1e-12)
