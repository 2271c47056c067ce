"""The controller's overhead: its share of a model's parameters and of its FLOPs per token.

`overhead_report(run)` (the command `python -m megatron_triroute.overhead`) builds the recipe's
`TriRouteGPTModel` on the CPU, in this process (a gloo group of one), for the recipe's system (TriRoute unless the name says `SCALE-SYSTEM`) and, for reference, Dense
(`system_config("dense", ...)` of the same backbone), and reports:

- parameters: those under every `layer.controller` vs all of the model's, counted from the
  built modules;
- FLOPs per token: one forward of one sequence in train mode (the training forward: relaxed
  attention, DeepSpeed's no-drop expert dispatch, the LM head) under
  `torch.utils.flop_counter.FlopCounterMode`, which counts matmul-like ops (2 FLOPs per MAC; norms,
  activations and softmax are not counted); the FLOPs attributed to the controller modules vs the
  total. Attention FLOPs grow with the sequence, the controller's do not, so the share depends
  on the sequence length (`--seq-len`; default: the recipe's).

Large recipes: every TriRoute layer has the same modules, except that in `layer_group`
attention only the first layer of each group has an attention head. So the report builds
`layers_built` layers (`--layers`; default: all of them when the dense backbone has at most
`FULL_BUILD_PARAMETERS` parameters, otherwise one attention group: `layer_group_size` layers in
`layer_group` mode, 1 otherwise), measures each built layer and what is outside the layers
(embedding, final norm, output layer), and scales the per-layer mean to the recipe's layer count:

    total(L) = outside + L * mean_over_built_layers(layer),   controller(L) = L * mean(controller)

which is exact when the layers built are one period of the layer pattern.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from ..config import ConfigError, TriRouteConfig
from ..distributed.one_process import build_model, single_process_parallel
from ..training.config import RunConfig

FULL_BUILD_PARAMETERS = 50_000_000
"""Dense backbones up to this size are built with all their layers (ours: well under a GiB of
fp32 weights and a few seconds of CPU forward)."""


@dataclass
class Overhead:
    """One system's numbers, scaled to the recipe's layer count."""

    system: str
    params_total: int
    params_controller: int
    flops_per_token_total: float
    flops_per_token_controller: float
    layers_built: int
    per_layer: list[dict] = field(default_factory=list)
    """Per built layer: params / controller params / FLOPs per token / controller FLOPs per token."""

    @property
    def params_share(self) -> float:
        return self.params_controller / self.params_total

    @property
    def flops_share(self) -> float:
        return self.flops_per_token_controller / self.flops_per_token_total

    def to_dict(self) -> dict:
        return {**asdict(self), "params_share": self.params_share, "flops_share": self.flops_share}


# --- measurement -----------------------------------------------------------------------------------
def _cpu_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


_CPU_FLOP_FORMULAS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops}
"""FlopCounterMode has formulas for the CUDA SDPA kernels only; on the CPU, SDPA runs
`_scaled_dot_product_flash_attention_for_cpu` (same math), which it would count as 0. Like the
CUDA formula, the count is the dense T x T product whatever the mask."""


def default_layers_built(cfg: TriRouteConfig) -> int:
    """All layers for small backbones, else one period of the layer pattern (see module doc)."""
    from ..training.recipes import dense_parameter_count

    L = cfg.model.n_layers
    if dense_parameter_count(cfg) <= FULL_BUILD_PARAMETERS:
        return L
    r = cfg.router
    period = r.layer_group_size if r.attn_routing and r.attn_granularity == "layer_group" else 1
    return min(L, period)


def measure(cfg: TriRouteConfig, system: str, groups, layers_built: int) -> Overhead:
    """Build `layers_built` layers of `cfg`, count and run them, scale to cfg.model.n_layers."""
    built = copy.deepcopy(cfg)
    built.model.n_layers = layers_built
    model = build_model(built, groups)
    layers = model.decoder.layers
    count = lambda module: sum(p.numel() for p in module.parameters())
    params_layer = [count(layer) for layer in layers]
    params_ctrl = [count(layer.controller) for layer in layers]
    params_outside = count(model) - sum(params_layer)

    T = built.model.seq_len
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, built.model.vocab_size, (1, T + 1), generator=g)
    model.train()  # the training forward: relaxed routed attention and no-drop expert dispatch
    with FlopCounterMode(display=False, custom_mapping=_CPU_FLOP_FORMULAS) as counter:
        model(tokens[:, :-1], torch.zeros(1, dtype=torch.long), labels=tokens[:, 1:])
    flops = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    root = type(model).__name__  # FlopCounterMode names modules "<root class>.<path>"
    flops_layer = [flops.get(f"{root}.decoder.layers.{i}", 0) / T for i in range(layers_built)]
    flops_ctrl = [flops.get(f"{root}.decoder.layers.{i}.controller", 0) / T for i in range(layers_built)]
    flops_outside = counter.get_total_flops() / T - sum(flops_layer)

    scale = cfg.model.n_layers / layers_built
    return Overhead(
        system=system,
        params_total=round(params_outside + scale * sum(params_layer)),
        params_controller=round(scale * sum(params_ctrl)),
        flops_per_token_total=flops_outside + scale * sum(flops_layer),
        flops_per_token_controller=scale * sum(flops_ctrl),
        layers_built=layers_built,
        per_layer=[{"params": p, "params_controller": c, "flops_per_token": f, "flops_per_token_controller": fc}
                   for p, c, f, fc in zip(params_layer, params_ctrl, flops_layer, flops_ctrl)],
    )


def overhead_report(run: RunConfig, layers_built: int | None = None) -> dict:
    """The recipe's system and Dense, measured on one backbone (see module doc)."""
    from ..systems import system_config

    cfg = run.triroute.validate()
    systems = {run.system: cfg}
    if run.system != "dense":
        systems["dense"] = system_config("dense", cfg)
    k = layers_built or default_layers_built(cfg)
    if not 1 <= k <= cfg.model.n_layers:
        raise ConfigError(f"layers_built={k}: must be in [1, n_layers={cfg.model.n_layers}]")
    with single_process_parallel() as groups:
        results = {name: measure(c, name, groups, k) for name, c in systems.items()}
    dense = results["dense"].flops_per_token_total
    out = {
        "recipe": run.name, "n_layers": cfg.model.n_layers, "layers_built": k, "seq_len": cfg.model.seq_len,
        "d_model": cfg.model.d_model, "d_router": cfg.router.d_router, "batch": 1, "mode": "train forward",
        "systems": {name: r.to_dict() for name, r in results.items()},
    }
    for name, r in results.items():
        out["systems"][name]["controller_flops_vs_dense"] = r.flops_per_token_controller / dense
        out["systems"][name]["flops_vs_dense"] = r.flops_per_token_total / dense
    return out


def format_table(report: dict) -> str:
    scaled = "" if report["layers_built"] == report["n_layers"] else (
        f", built {report['layers_built']} layer(s) and scaled per layer")
    lines = [
        f"recipe {report['recipe']}: {report['n_layers']} layers{scaled}, d={report['d_model']}, "
        f"d_r={report['d_router']}, seq_len {report['seq_len']}, one sequence, {report['mode']} "
        "(FlopCounterMode: matmul FLOPs)",
        f"{'system':<24} {'params':>14} {'controller':>12} {'share':>8}   "
        f"{'FLOPs/token':>12} {'controller':>12} {'share':>8} {'ctrl/dense':>10} {'total/dense':>11}",
    ]
    for name, s in report["systems"].items():
        lines.append(
            f"{name:<24} {s['params_total']:>14,} {s['params_controller']:>12,} {100 * s['params_share']:>7.3f}%   "
            f"{s['flops_per_token_total']:>12.4g} {s['flops_per_token_controller']:>12.4g} "
            f"{100 * s['flops_share']:>7.3f}% {100 * s['controller_flops_vs_dense']:>9.3f}% {s['flops_vs_dense']:>11.3f}"
        )
    return "\n".join(lines)
