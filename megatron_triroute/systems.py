"""Named systems of the paper's comparison (Sec. Experimental Setup) and the ablation variants
(Table "Ablations"), each as a config built from a base config.

    system_config("moe", base)            -> validated deep copy of `base` configured as MoE-only
    knobs("moe")                          -> the knob(s) the matched-budget protocol sweeps
    describe("moe")                       -> what the preset is, its knob, how the protocol sets it
    list_presets()                        -> SYSTEMS + VARIANTS

Matched-budget protocol (Sec. Experimental Setup): the budget is a pair (inference FLOPs, KV
memory) as fractions of the dense model. Each baseline exposes its own knob(s); the protocol
sweeps them, measures the realised cost of each trained point (hard accounting,
`routing.cost.noise_free_cost`), and reads off the point at the target budget. TriRoute instead
names the target directly (`budget.flops_target`, `budget.mem_target`) and its online Lagrangian
lands on it. Baselines therefore run with the budget term disabled.

Choices that are ours (the paper leaves them open):
- Baselines train with the standard single-axis recipe, Switch load loss + z-loss, and none of
  TriRoute's coupling-aware additions (whitening, gradient balance, entropy floor), which the
  paper presents as having no analogue in single-axis methods.
- MoE-only and Independent pin the expert width to the base's (`expert_width`), so their knob
  `top_k` trades FLOPs at fixed experts instead of re-deriving the width from k.
- KV-quant-only and Independent write the cache at `DEFAULT_KV_BITS` unless the base already
  sets a reduced `uniform_bits` (< 16), which is then kept.
- The "uniform_bits" variant writes every token at the widest width of `router.bits` whose
  cache fits `budget.mem_target` (the smallest width when none fits).
- MoD here is the paper's own reading of MoD as a TriRoute special case (null expert together
  with attention skip): a skipped token reads nothing and runs no FFN, but its K/V are still
  written, so MoD saves FLOPs, not cache memory.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

from .config import ConfigError, TriRouteConfig
from .routing.cost import expert_width
from .routing.mod import MoDConfig
from .routing.quant import kv_bits_per_token

SYSTEMS = ("dense", "mod", "moe", "kvquant", "independent", "triroute")
"""The six systems compared at matched budget, in the paper's order (TriRoute last)."""

VARIANTS = (
    "token_attention", "layer_group_attention", "separate_routers", "single_head", "no_grad_balance",
    "no_whitening", "no_entropy_floor", "reinforce", "no_null_expert", "uniform_bits",
)
"""Table "Ablations": TriRoute with exactly one switch flipped."""

DEFAULT_KV_BITS = 4
"""Cache width of KV-quant-only and Independent when the base does not set one below 16 (ours)."""


@dataclass(frozen=True)
class Knob:
    """One knob a system exposes to the matched-budget sweep."""

    path: str
    """Dotted config path, e.g. "router.top_k"."""
    resource: str
    """The budget resource it mainly trades: "flops" or "mem"."""
    default: float | int
    """Its value in the preset built from the given base."""
    choices: tuple[int, ...] | None = None
    """Discrete values the sweep may take (None: continuous, see `bounds`)."""
    bounds: tuple[float, float] | None = None
    """Continuous range (low, high], low exclusive."""
    effect: str = ""


def list_presets() -> tuple[str, ...]:
    """Every name `system_config` accepts."""
    return SYSTEMS + VARIANTS


def system_config(name: str, base: TriRouteConfig) -> TriRouteConfig:
    """A validated deep copy of `base` configured as system or variant `name`."""
    _check_name(name)
    cfg = copy.deepcopy(base)
    if name in _SYSTEM_BUILDERS:
        _SYSTEM_BUILDERS[name](cfg)
    else:
        _triroute(cfg)
        _VARIANT_SWITCHES[name](cfg)
    return cfg.validate()


def knobs(name: str, base: TriRouteConfig | None = None) -> tuple[Knob, ...]:
    """The knob(s) system `name` exposes, with ranges for the preset built from `base`
    (defaults: `TriRouteConfig()`)."""
    cfg = system_config(name, base if base is not None else TriRouteConfig())
    r = cfg.router
    capacity = Knob("router.mod_capacity", "flops", MoDConfig.from_router(r).capacity, bounds=(0.0, 1.0),
                    effect="fraction of each sequence's tokens a block processes (training top-k; the "
                           "causal predictor is trained to match it at inference)")
    top_k = Knob("router.top_k", "flops", r.top_k, choices=tuple(range(1, r.num_experts + 1)),
                 effect=f"experts run per (processed) token, each of width {expert_width(cfg.model, r)}")
    width = Knob("router.uniform_bits", "mem", r.uniform_bits, choices=(2, 4, 8),
                 effect="bit-width every token's K/V is written at (16 = the dense cache)")
    targets = (
        Knob("budget.flops_target", "flops", cfg.budget.flops_target, bounds=(0.0, 1.0),
             effect="C*_flops, the FLOPs target of the online Lagrangian"),
        Knob("budget.mem_target", "mem", cfg.budget.mem_target, bounds=(0.0, 1.0),
             effect="C*_mem, the KV-memory target of the online Lagrangian"),
    )
    return {
        "dense": (), "mod": (capacity,), "moe": (top_k,), "kvquant": (width,),
        "independent": (capacity, top_k, width),
    }.get(name, targets)


def describe(name: str) -> str:
    """One paragraph: what the system or variant is, which knob it exposes, how it is set."""
    _check_name(name)
    doc = (_SYSTEM_BUILDERS.get(name) or _VARIANT_SWITCHES[name]).__doc__
    if name in VARIANTS:
        doc = f"TriRoute with one switch flipped ({doc}). Knobs: the budget targets, as for TriRoute."
    return " ".join(doc.split())


def _check_name(name: str) -> None:
    if name not in list_presets():
        raise ConfigError(f"unknown system {name!r}. Fix: use one of the systems {', '.join(SYSTEMS)} "
                          f"or the variants {', '.join(VARIANTS)}.")


# --- the six systems ---------------------------------------------------------------------------
def _dense(cfg: TriRouteConfig) -> None:
    """Dense: the quality ceiling at full cost. Every head reads `full`, one dense FFN, 16-bit
    cache, no budget. No knob: it is the reference every budget fraction is measured against."""
    _baseline(cfg, kind="triroute", attn=False, experts=False, bits=16)


def _mod(cfg: TriRouteConfig) -> None:
    """MoD-only (Raposo et al. 2024): a scalar router per layer sends each token through the whole
    block (full attention, the one dense expert of width d_ff) or around it (skip + null).
    Knob: `router.mod_capacity`, the processed fraction; the protocol sweeps it and reads off the
    capacity whose measured FLOPs land on the target. 16-bit cache, no budget term."""
    _baseline(cfg, kind="mod", attn=True, experts=True, bits=16)
    r = cfg.router
    r.num_experts, r.top_k, r.null_expert = 1, 1, True
    cfg.model.expert_d_ff = cfg.model.d_ff


def _moe(cfg: TriRouteConfig) -> None:
    """MoE-only (Switch/GShard): top-k of E real experts (no null), every head `full`, 16-bit
    cache, no budget term. Knob: `router.top_k` at the base's expert width; the protocol picks the
    k whose active FLOPs land on the target (with the paper's sizing, the base k matches the dense
    FFN's FLOPs)."""
    width = expert_width(cfg.model, cfg.router)
    _baseline(cfg, kind="triroute", attn=False, experts=True, bits=16)
    cfg.router.null_expert = False
    cfg.model.expert_d_ff = width


def _kvquant(cfg: TriRouteConfig) -> None:
    """KV-quant-only (KIVI-style per-token group quantisation): dense compute, every token's K/V
    written at one width. Knob: `router.uniform_bits` (DEFAULT_KV_BITS unless the base sets a
    width below 16); the protocol picks the width whose cache lands on the memory target."""
    _baseline(cfg, kind="triroute", attn=False, experts=False, bits=_kv_width(cfg))


def _independent(cfg: TriRouteConfig) -> None:
    """Independent combo: MoD + MoE + KV-quant, each with its own router and knob
    (`router.mod_capacity`, `router.top_k`, `router.uniform_bits`). The protocol grid-searches the
    three separately so that together they land on the target budget; no shared trunk, no budget
    term."""
    width = expert_width(cfg.model, cfg.router)
    _baseline(cfg, kind="independent", attn=True, experts=True, bits=_kv_width(cfg))
    cfg.router.null_expert = False
    cfg.model.expert_d_ff = width


def _triroute(cfg: TriRouteConfig) -> None:
    """TriRoute: the base config as given, with `router.kind = "triroute"`. Knobs: the budget
    targets `budget.flops_target`, `budget.mem_target`, met by the online Lagrangian."""
    cfg.router.kind = "triroute"


def _baseline(cfg: TriRouteConfig, kind: str, attn: bool, experts: bool, bits: int) -> None:
    """Shared by the baselines: the routing family, which axes route, the cache width, the
    single-axis balancing recipe, and no budget term (each baseline's knob sets its cost)."""
    r = cfg.router
    r.kind, r.attn_routing, r.expert_routing = kind, attn, experts
    r.bit_routing, r.uniform_bits = False, bits
    r.attn_granularity = "token" if attn else r.attn_granularity  # MoD decides whole tokens
    r.whitening = r.grad_balance = False
    cfg.losses.use_entropy_floor = False
    cfg.budget.enabled = False


def _kv_width(cfg: TriRouteConfig) -> int:
    return cfg.router.uniform_bits if cfg.router.uniform_bits < 16 else DEFAULT_KV_BITS


# --- Table "Ablations" variants: TriRoute with one switch flipped ----------------------------------
def _uniform_bits(cfg: TriRouteConfig) -> None:
    """router.bit_routing = False, every token written at the widest width of `router.bits` whose
    cache fits `budget.mem_target`"""
    m, r = cfg.model, cfg.router
    dense = 2 * m.d_kv * 16
    fits = [b for b in r.bits if kv_bits_per_token(b, m.d_kv, r.group_size_for(m)) <= cfg.budget.mem_target * dense]
    r.bit_routing, r.uniform_bits = False, max(fits) if fits else min(r.bits)


def _set(path: str, value) -> Callable[[TriRouteConfig], None]:
    section, name = path.split(".")

    def switch(cfg: TriRouteConfig) -> None:
        setattr(getattr(cfg, section), name, value)

    switch.__doc__ = f"{path} = {value!r}"
    return switch


_SYSTEM_BUILDERS: dict[str, Callable[[TriRouteConfig], None]] = {
    "dense": _dense, "mod": _mod, "moe": _moe, "kvquant": _kvquant, "independent": _independent,
    "triroute": _triroute,
}

_VARIANT_SWITCHES: dict[str, Callable[[TriRouteConfig], None]] = {
    "token_attention": _set("router.attn_granularity", "token"),
    "layer_group_attention": _set("router.attn_granularity", "layer_group"),
    "separate_routers": _set("router.sharing", "separate"),
    "single_head": _set("router.sharing", "single_head"),
    "no_grad_balance": _set("router.grad_balance", False),
    "no_whitening": _set("router.whitening", False),
    "no_entropy_floor": _set("losses.use_entropy_floor", False),
    "reinforce": _set("router.estimator", "reinforce"),
    "no_null_expert": _set("router.null_expert", False),
    "uniform_bits": _uniform_bits,
}
assert set(_SYSTEM_BUILDERS) == set(SYSTEMS) and set(_VARIANT_SWITCHES) == set(VARIANTS)
