"""The typed configuration tree for the TriRoute routing core.

Every component reads one dataclass; `TriRouteConfig` groups them and is what a
checkpoint stores (`to_dict` / `from_dict`). `validate()` runs once at start-up
and raises `ConfigError` naming the field, the bad value and the fix.

Values marked "(ours)" are choices the paper leaves open.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from .input_errors import InputError


class ConfigError(InputError, ValueError):
    """A configuration value is invalid; the message names field, value and fix."""


def _fail(path: str, value: Any, why: str, fix: str) -> None:
    raise ConfigError(f"{path}={value!r}: {why}. Fix: {fix}.")


@dataclass
class ModelConfig:
    """Backbone shape the controller and the cost model need."""

    d_model: int = 64
    """Model width d."""
    n_layers: int = 2
    """Number of transformer layers L."""
    n_heads: int = 4
    """Query heads H; head size d_h = d_model / n_heads."""
    n_kv_heads: int = 1
    """Key/value heads H_kv (GQA); the paper uses H/4."""
    d_ff: int = 128
    """Dense FFN width d_f (SwiGLU). Each expert's width is derived from it (see `expert_d_ff`)."""
    vocab_size: int = 256
    seq_len: int = 64
    expert_d_ff: int = 0
    """Width of one expert; 0 = derive so that top-k active FFN MACs match the dense FFN:
    `round(d_ff / top_k)` rounded up to a multiple of 8 (ours: rounding up keeps the
    active FFN at least as wide as the dense one)."""

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    @property
    def d_kv(self) -> int:
        """Width of one token's keys (and of its values): H_kv * d_h."""
        return self.n_kv_heads * self.d_head

    def validate(self, path: str = "model") -> None:
        for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "vocab_size", "seq_len"):
            if getattr(self, name) <= 0:
                _fail(f"{path}.{name}", getattr(self, name), "must be positive", "set a positive integer")
        if self.d_model % self.n_heads:
            _fail(f"{path}.d_model", self.d_model, f"not divisible by n_heads={self.n_heads}",
                  "choose d_model as a multiple of n_heads")
        if self.n_heads % self.n_kv_heads:
            _fail(f"{path}.n_kv_heads", self.n_kv_heads, f"does not divide n_heads={self.n_heads}",
                  "choose n_kv_heads dividing n_heads (the paper uses n_heads // 4)")
        if self.expert_d_ff < 0:
            _fail(f"{path}.expert_d_ff", self.expert_d_ff, "must be >= 0", "use 0 to derive it")


ExpertCompute = Literal["auto", "grouped", "deepspeed"]
EXPERT_COMPUTE: tuple[str, ...] = get_args(ExpertCompute)
"""How one rank's experts may run (`RouterConfig.expert_compute`, `experts.TriRouteExperts`)."""
EXPERT_COMPUTE_FIX = "use " + ", ".join(EXPERT_COMPUTE[:-1]) + " or " + EXPERT_COMPUTE[-1]
LocalAttention = Literal["auto", "blocks", "flex"]
LOCAL_ATTENTION: tuple[str, ...] = get_args(LocalAttention)
"""How the local mode's attention runs (`RouterConfig.local_attention`, `model.mode_attention`)."""
FLEX_MIN_D_HEAD = 16
"""The least head dim FlexAttention's kernel takes."""
RouterCompile = Literal["auto", "inductor", "aot_eager", "eager"]
ROUTER_COMPILE: tuple[str, ...] = get_args(RouterCompile)
"""`RouterConfig.compile`'s choices besides None (eager): `routing.compiled`."""


@dataclass
class RouterConfig:
    """The controller: features, trunk, heads, relaxation, and the Table 4 switches."""

    kind: Literal["triroute", "mod", "independent"] = "triroute"
    """Which router family builds the per-layer decisions (see `routing.factory`):
    triroute (the joint controller), mod (Mixture-of-Depths block router), independent
    (MoD + MoE + KV-quant, each with its own router and knob)."""
    d_router: int = 128
    """Trunk width d_r."""
    num_experts: int = 8
    """Real experts E (the null expert, when enabled, is an extra option at index 0)."""
    top_k: int = 2
    """Experts selected per token, counting the null expert when it is chosen."""
    window: int = 128
    """Local attention window w: a local token at position t reads keys max(0, t-w)..t,
    i.e. min(t, w) + 1 keys (ours: the paper's K_[t-w, t] taken inclusively)."""
    bits: tuple[int, ...] = (2, 4, 8, 16)
    """Bit-widths the bit head chooses among, in logit order; each one of the cache kernels'
    `triroute_kernels.quant.SUPPORTED_BITS`. The default is written out, not `SUPPORTED_BITS`:
    a width the kernels gain later must not silently change every recipe's choices (and its
    checkpoints' logit count); a recipe opts in by listing it."""
    kv_group_size: int = 32
    """Quantisation group size along the head dimension; groups never span heads, so it must
    divide d_head (ours: 32, or d_head when smaller)."""
    tau_start: float = 2.0
    """Gumbel temperature at step 0 (attention and bit axes)."""
    tau_end: float = 0.5
    """Gumbel temperature at the last step (cosine schedule)."""
    # --- side features psi -------------------------------------------------------------
    max_doc_position: int = 4096
    """Document position feature is log1p(pos) / log1p(max_doc_position) (ours)."""
    # --- Table 4 switches ----------------------------------------------------------------
    attn_granularity: Literal["per_head", "token", "layer_group"] = "per_head"
    """per_head: one mode per query head (default). token: one mode per token shared by all
    heads. layer_group: one token-level mode per group of `layer_group_size` consecutive
    layers, decided by the group's first layer and reused by the others."""
    layer_group_size: int = 4
    sharing: Literal["shared_trunk", "separate", "single_head"] = "shared_trunk"
    """shared_trunk: one trunk, three linear heads (default). separate: three independent
    trunks, one per axis. single_head: one trunk and one linear head emitting all logits,
    with one whitening over the concatenated logit vector."""
    estimator: Literal["st_gumbel", "reinforce"] = "st_gumbel"
    """st_gumbel: straight-through Gumbel-softmax. reinforce: hard samples forward with no
    straight-through path; the attention/bit heads learn by the score-function estimator
    (reward = -per-token LM loss, baseline = EMA of the batch-mean reward)."""
    grad_balance: bool = True
    """Eq. gradbal on/off."""
    grad_balance_momentum: float = 0.99
    """rho <- m * rho + (1 - m) * ||grad|| (ours: conventional EMA reading of the paper's m)."""
    whitening: bool = True
    """Eq. whiten on/off."""
    whitening_momentum: float = 0.99
    whitening_eps: float = 1e-5
    null_expert: bool = True
    """False: no null option, the expert head covers only the E real experts."""
    bit_routing: bool = True
    """False: every token is written at `uniform_bits`; the bit head is not built."""
    uniform_bits: int = 16
    """Bit-width used when bit routing is off."""
    attn_routing: bool = True
    """False: every head reads in `full` mode; the attention head is not built (MoE-only,
    KV-quant-only and Dense systems)."""
    expert_routing: bool = True
    """False: the FFN is dense; the expert head is not built."""
    # --- MoD baseline knobs (router.kind = "mod" / "independent") --------------------------
    mod_capacity: float = 0.5
    """MoD: fraction c of each sequence's tokens a block processes in training (k = max(1, round(c*T)))."""
    mod_predictor_weight: float = 1e-2
    """MoD: weight of the causal predictor's BCE (the family's extra_loss)."""
    mod_predictor_width: int = 128
    """MoD: hidden width of the causal predictor MLP."""
    # --- execution ------------------------------------------------------------------------
    expert_compute: ExpertCompute = "auto"
    """How the experts run where one rank holds them all (expert parallel 1, no tensor parallel, no
    capacity factor): `grouped`, every route in three grouped matmuls with no host read and no
    capacity (`experts/grouped.py`); `deepspeed`, DeepSpeed's MOELayer dispatch as with expert
    parallelism (capacity from a host read, one call per expert); `auto`, grouped (on a CPU too:
    over the stacked expert weights it measured as fast as DeepSpeed's dispatch there, with fewer
    ops and host reads; docs/parallelism.md). Expert-parallel runs always take DeepSpeed's."""
    local_attention: LocalAttention = "auto"
    """How the relaxed path computes the local mode (`model/mode_attention.py`): `blocks`, SDPA over
    query blocks of 16 and their b + w keys (copies of K/V per block; runs anywhere); `flex`,
    FlexAttention with a sliding-window block mask, compiled into one fused kernel on a GPU (no
    backward on a CPU; d_head >= 16); `auto`, flex on a GPU where d_head >= 16 (the faster there,
    docs/gpu.md), blocks otherwise. The same attention either way."""
    compile: RouterCompile | None = None
    """torch.compile backend for the routing ops (counter-based noise, ST-Gumbel relaxation and the
    relaxed K/V write's quantisation, `routing.compiled`); None: eager; `auto`: inductor for a
    model on a GPU, eager on a CPU, where compiling does not pay (docs/overhead.md). inductor is
    the one that fuses; aot_eager/eager only trace."""

    @property
    def num_expert_options(self) -> int:
        return self.num_experts + (1 if self.null_expert else 0)

    def validate(self, path: str = "router", model: ModelConfig | None = None) -> None:
        if self.kind not in ("triroute", "mod", "independent"):
            _fail(f"{path}.kind", self.kind, "unknown router family", "use triroute, mod or independent")
        if self.d_router <= 0:
            _fail(f"{path}.d_router", self.d_router, "must be positive", "use e.g. 128")
        if self.num_experts < 1:
            _fail(f"{path}.num_experts", self.num_experts, "must be >= 1", "use e.g. 8")
        if not 1 <= self.top_k <= self.num_expert_options:
            _fail(f"{path}.top_k", self.top_k,
                  f"must be in [1, num_experts{' + 1 (null)' if self.null_expert else ''}"
                  f" = {self.num_expert_options}]", "lower top_k or add experts")
        if self.window < 0:
            _fail(f"{path}.window", self.window, "must be >= 0", "use e.g. 128")
        # The widths the cache can store are the kernels' (one definition). Imported here, not at
        # the top: that package imports torch, and this module stays importable without it.
        from triroute_kernels.quant import SUPPORTED_BITS

        if not self.bits or any(b not in SUPPORTED_BITS for b in self.bits):
            _fail(f"{path}.bits", self.bits, f"every bit-width must be one of {SUPPORTED_BITS}",
                  "remove unsupported widths")
        if len(set(self.bits)) != len(self.bits) or list(self.bits) != sorted(self.bits):
            _fail(f"{path}.bits", self.bits, "must be strictly increasing", "sort and de-duplicate")
        if self.uniform_bits not in SUPPORTED_BITS:
            _fail(f"{path}.uniform_bits", self.uniform_bits, f"must be one of {SUPPORTED_BITS}",
                  f"pick one of {SUPPORTED_BITS}")
        if not 0 < self.tau_end <= self.tau_start:
            _fail(f"{path}.tau_end", self.tau_end, f"must satisfy 0 < tau_end <= tau_start={self.tau_start}",
                  "use the paper's 2.0 -> 0.5")
        for name in ("grad_balance_momentum", "whitening_momentum"):
            if not 0.0 <= getattr(self, name) < 1.0:
                _fail(f"{path}.{name}", getattr(self, name), "must be in [0, 1)", "use 0.99")
        if self.attn_granularity not in ("per_head", "token", "layer_group"):
            _fail(f"{path}.attn_granularity", self.attn_granularity, "unknown",
                  "use per_head, token or layer_group")
        if self.layer_group_size < 1:
            _fail(f"{path}.layer_group_size", self.layer_group_size, "must be >= 1", "use e.g. 4")
        if self.sharing not in ("shared_trunk", "separate", "single_head"):
            _fail(f"{path}.sharing", self.sharing, "unknown", "use shared_trunk, separate or single_head")
        if self.estimator not in ("st_gumbel", "reinforce"):
            _fail(f"{path}.estimator", self.estimator, "unknown", "use st_gumbel or reinforce")
        if not 0.0 < self.mod_capacity <= 1.0:
            _fail(f"{path}.mod_capacity", self.mod_capacity, "the processed fraction must be in (0, 1]", "use e.g. 0.5")
        if self.mod_predictor_weight < 0:
            _fail(f"{path}.mod_predictor_weight", self.mod_predictor_weight, "must be >= 0", "use 1e-2")
        if self.mod_predictor_width <= 0:
            _fail(f"{path}.mod_predictor_width", self.mod_predictor_width, "must be positive", "use 128")
        if self.expert_compute not in EXPERT_COMPUTE:
            _fail(f"{path}.expert_compute", self.expert_compute, "unknown", EXPERT_COMPUTE_FIX)
        if self.local_attention not in LOCAL_ATTENTION:
            _fail(f"{path}.local_attention", self.local_attention, "unknown", "use " + ", ".join(LOCAL_ATTENTION))
        if self.local_attention == "flex" and model is not None and model.d_head < FLEX_MIN_D_HEAD:
            _fail(f"{path}.local_attention", self.local_attention,
                  f"FlexAttention's kernel needs d_head >= {FLEX_MIN_D_HEAD} (d_head={model.d_head})",
                  "use blocks or auto")
        if self.compile is not None and self.compile not in ROUTER_COMPILE:
            _fail(f"{path}.compile", self.compile, "not a torch.compile backend for the routing ops",
                  "use " + ", ".join(ROUTER_COMPILE) + ", or leave it unset (eager)")
        if self.kv_group_size <= 0:
            _fail(f"{path}.kv_group_size", self.kv_group_size, "must be positive", "use 32")
        if model is not None and model.d_head % self.group_size_for(model):
            _fail(f"{path}.kv_group_size", self.kv_group_size,
                  f"must divide d_head={model.d_head} (groups never span heads)",
                  f"choose a divisor of {model.d_head}")

    def group_size_for(self, model: ModelConfig) -> int:
        """Effective quantisation group size: `kv_group_size`, capped at d_head."""
        return min(self.kv_group_size, model.d_head)


@dataclass
class LossConfig:
    """Weights of Eq. total's balancing terms (Appendix B)."""

    load_weight: float = 1e-2
    """alpha: Switch load-balancing loss."""
    z_weight: float = 1e-3
    """beta: router z-loss."""
    entropy_weight: float = 1e-3
    """gamma: marginal-entropy floor hinge."""
    entropy_floor: float = 0.5
    """zeta: fraction of log|O| below which the hinge acts."""
    use_entropy_floor: bool = True
    """Table 4 switch: entropy floor on/off."""

    def validate(self, path: str = "losses") -> None:
        for name in ("load_weight", "z_weight", "entropy_weight"):
            if getattr(self, name) < 0:
                _fail(f"{path}.{name}", getattr(self, name), "must be >= 0", "use the Appendix B value")
        if not 0.0 <= self.entropy_floor <= 1.0:
            _fail(f"{path}.entropy_floor", self.entropy_floor, "must be in [0, 1]", "use 0.5")


@dataclass
class BudgetConfig:
    """The online Lagrangian budget (Sec. budget)."""

    flops_target: float = 0.55
    """C*_flops as a fraction of the dense model's FLOPs, in (0, 1]."""
    mem_target: float = 0.40
    """C*_mem as a fraction of the dense 16-bit KV cache, in (0, 1]."""
    dual_step: float = 0.05
    """rho_lambda: projected dual-ascent step."""
    ema_momentum: float = 0.9
    """EMA momentum of the realised cost the duals are updated on (ours)."""
    dual_kp: float = 0.5
    """k_P: proportional gain of the PI dual update (ours; 0 = the paper's pure dual ascent)."""
    lambda_init: float = 0.0
    """Initial multipliers (ours: 0, the constraint is priced only once violated)."""
    tied: bool = False
    """True: one multiplier for both resources, updated on the summed violation
    sum_r (C_r - C*_r) and applied to the summed surrogate (Appendix A's tied knob)."""
    enabled: bool = True
    """False: no budget term (Dense, MoE-only and fixed-knob baselines)."""

    def validate(self, path: str = "budget") -> None:
        for name in ("flops_target", "mem_target"):
            v = getattr(self, name)
            if not 0.0 < v <= 1.0:
                _fail(f"{path}.{name}", v, "a budget is a fraction of the dense cost and must be in (0, 1]",
                      "e.g. 0.55 for FLOPs, 0.40 for memory")
        if self.dual_step <= 0:
            _fail(f"{path}.dual_step", self.dual_step, "must be positive", "use 0.05")
        if not 0.0 <= self.ema_momentum < 1.0:
            _fail(f"{path}.ema_momentum", self.ema_momentum, "must be in [0, 1)", "use 0.9")
        if self.dual_kp < 0:
            _fail(f"{path}.dual_kp", self.dual_kp, "a proportional gain is non-negative", "use 0.0 to disable")
        if self.lambda_init < 0:
            _fail(f"{path}.lambda_init", self.lambda_init, "multipliers are non-negative", "use 0.0")


@dataclass
class TriRouteConfig:
    """Root of the routing config tree; saved in every checkpoint."""

    model: ModelConfig = field(default_factory=ModelConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    losses: LossConfig = field(default_factory=LossConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    seed: int = 1234
    """Key of the counter-based Gumbel noise (and of initialisation)."""

    def validate(self) -> "TriRouteConfig":
        self.model.validate("model")
        self.router.validate("router", self.model)
        self.losses.validate("losses")
        self.budget.validate("budget")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "TriRouteConfig":
        return _from_dict(cls, data, "config")


def _from_dict(cls, data: dict, path: str):
    """Rebuild a dataclass tree, refusing unknown keys (a typo must not pass silently)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping, got {type(data).__name__}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(data) - set(known)
    if unknown:
        raise ConfigError(f"{path}: unknown keys {sorted(unknown)}. Fix: use one of {sorted(known)}.")
    kwargs = {}
    for name, value in data.items():
        sub = known[name].default_factory if known[name].default_factory is not dataclasses.MISSING else None
        if sub is not None and dataclasses.is_dataclass(sub):
            kwargs[name] = _from_dict(sub, value, f"{path}.{name}")
        elif isinstance(value, list):
            kwargs[name] = tuple(value)
        else:
            kwargs[name] = value
    return cls(**kwargs)


@functools.lru_cache(maxsize=None)
def field_types(cls) -> dict[str, Any]:
    """The declared type of every field of the dataclass `cls` (annotations resolved)."""
    return typing.get_type_hints(cls)


def optional_of(hint: Any) -> Any | None:
    """X for a declared `X | None`, else None."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]
    return None


def describe_type(hint: Any) -> str:
    """How an error names a declared type: 'an integer', 'true or false', 'one of ...'."""
    inner = optional_of(hint)
    if inner is not None:
        return f"{describe_type(inner)}, or none"
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(hint)))
    if typing.get_origin(hint) is tuple:
        return f"a comma-separated list of {describe_type(typing.get_args(hint)[0]).split(' ', 1)[-1]}s"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(hint, str(hint))


def has_type(value: Any, hint: Any) -> bool:
    """Whether `value` is of the declared type `hint` (a bool is not an integer; an integer is a number)."""
    inner = optional_of(hint)
    if inner is not None:
        return value is None or has_type(value, inner)
    origin = typing.get_origin(hint)
    if origin is Literal:
        return any(value == choice and type(value) is type(choice) for choice in typing.get_args(hint))
    if origin is tuple:
        kind = typing.get_args(hint)[0]
        return isinstance(value, tuple) and all(has_type(v, kind) for v in value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint in (bool, str):
        return type(value) is hint
    return True  # a type this check does not know: the field's own validation decides


def check_types(config: Any, path: str = "") -> None:
    """Raise ConfigError naming the first field of the dataclass tree `config` whose value is not of
    its declared type (an override or a hand-written config can put a string where a number goes)."""
    for f in dataclasses.fields(config):
        value, hint = getattr(config, f.name), field_types(type(config))[f.name]
        where = f"{path}.{f.name}" if path else f.name
        if dataclasses.is_dataclass(hint):
            check_types(value, where)
        elif not has_type(value, hint):
            _fail(where, value, f"is a {type(value).__name__}, the field takes {describe_type(hint)}",
                  f"set {where} to {describe_type(hint)}")
