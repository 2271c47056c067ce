"""Recipes: Python functions returning a RunConfig.

`tiny` trains on a CPU in minutes. `160m`, `410m`, `1p3b` use the backbone shapes of the
paper's model table (Pythia-matched) with its Appendix B hyperparameters. Any recipe takes a
system or Table 4 variant as `NAME-SYSTEM` (e.g. `410m-moe`, `160m-no_whitening`).

Values the paper leaves open are ours and marked so:
- peak LR per scale (the paper gives a 3-6e-4 range): 160m 6e-4, 410m 4.5e-4, 1p3b 3e-4;
- expert width ceil(d_f / top_k) rounded up to a multiple of 8 (see ModelConfig.expert_d_ff);
- KV quantisation group 32 channels; budget EMA momentum 0.9; min LR 10% of peak;
- steps = ceil(20 x parameters / tokens per step), parameters counted from the shapes below
  (dense backbone, the compute-optimal reference all six systems share);
- data blend: proportional to the size of each train prefix (Megatron's default).
"""

from __future__ import annotations

import math

from ..config import TriRouteConfig
from .config import ConfigError, DataConfig, OptimConfig, RunConfig, TrainConfig

SCALES = ("tiny", "160m", "410m", "1p3b")


def dense_parameter_count(cfg: TriRouteConfig) -> int:
    """Parameters of the dense backbone: embeddings + untied output + per layer (GQA attention,
    SwiGLU FFN, two RMSNorms) + final norm."""
    m = cfg.model
    attn = m.d_model * (m.n_heads + 2 * m.n_kv_heads) * m.d_head + m.n_heads * m.d_head * m.d_model
    ffn = 3 * m.d_model * m.d_ff
    return 2 * m.vocab_size * m.d_model + m.n_layers * (attn + ffn + 2 * m.d_model) + m.d_model


def _paper_scale(name: str, d: int, layers: int, heads: int, kv_heads: int, d_ff: int, batch_tokens: int,
                 lr: float) -> RunConfig:
    tr = TriRouteConfig()
    m = tr.model
    m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.d_ff = d, layers, heads, kv_heads, d_ff
    m.seq_len, m.vocab_size = 2048, 50304  # replaced by the tokenizer's size (padded) at start
    tr.router.d_router, tr.router.num_experts, tr.router.top_k, tr.router.window = 128, 8, 2, 128
    gbs = batch_tokens // m.seq_len
    steps = math.ceil(20 * dense_parameter_count(tr) / (gbs * m.seq_len))
    return RunConfig(
        name=name, triroute=tr,
        optim=OptimConfig(lr=lr, warmup_steps=2000),
        train=TrainConfig(steps=steps, global_batch_size=gbs, micro_batch_size=4, eval_interval=1000,
                          eval_batches=16, save_interval_steps=1000, save_interval_minutes=30.0),
        data=DataConfig(path=f"data/{name}"), output_dir=f"runs/{name}",
    )


def recipe_160m() -> RunConfig:
    return _paper_scale("160m", d=768, layers=12, heads=12, kv_heads=3, d_ff=2048, batch_tokens=2**19, lr=6e-4)


def recipe_410m() -> RunConfig:
    return _paper_scale("410m", d=1024, layers=24, heads=16, kv_heads=4, d_ff=2731, batch_tokens=2**19, lr=4.5e-4)


def recipe_1p3b() -> RunConfig:
    return _paper_scale("1p3b", d=2048, layers=24, heads=16, kv_heads=4, d_ff=5461, batch_tokens=2**20, lr=3e-4)


def recipe_tiny() -> RunConfig:
    """A CPU-sized TriRoute model (~2.4M parameters with its 4 experts per layer, sequence 128):
    2,200 steps of 1,024 tokens (2.3M tokens), about ten minutes on 2 CPU cores."""
    tr = TriRouteConfig()
    m = tr.model
    m.d_model, m.n_layers, m.n_heads, m.n_kv_heads, m.d_ff, m.seq_len, m.vocab_size = 128, 4, 4, 1, 384, 128, 4096
    r = tr.router
    r.d_router, r.num_experts, r.top_k, r.window, r.kv_group_size = 64, 4, 2, 16, 32
    return RunConfig(
        name="tiny", triroute=tr,
        optim=OptimConfig(lr=2e-3, warmup_steps=20),
        train=TrainConfig(steps=2200, global_batch_size=8, micro_batch_size=8, log_interval=20,
                          eval_interval=550, eval_batches=8, save_interval_steps=550, save_interval_minutes=10.0),
        data=DataConfig(path="data/tiny"), output_dir="runs/tiny",
    )


_RECIPES = {"tiny": recipe_tiny, "160m": recipe_160m, "410m": recipe_410m, "1p3b": recipe_1p3b}


def get_recipe(name: str) -> RunConfig:
    """`SCALE` or `SCALE-SYSTEM` (a system or Table 4 variant of `megatron_triroute.systems`)."""
    from ..systems import list_presets, system_config

    scale, _, system = name.partition("-")
    if scale not in _RECIPES:
        raise ConfigError(f"unknown recipe {name!r}; known: {', '.join(_RECIPES)} (each optionally -SYSTEM, e.g. "
                          f"tiny-moe). Fix: {_closest('--recipe ', scale, _RECIPES)}")
    if system and system not in list_presets():
        raise ConfigError(f"unknown system {system!r} in recipe {name!r}; known: {', '.join(list_presets())}. "
                          f"Fix: {_closest(f'--recipe {scale}-', system, list_presets())}")
    run = _RECIPES[scale]()
    run.name = name
    run.output_dir = f"runs/{name}"
    if system:
        run.system = system
        run.triroute = system_config(system, run.triroute)
    return run


def _closest(prefix: str, given: str, known) -> str:
    """'did you mean PREFIXNAME?' for the known name nearest `given`, else 'use one of those'."""
    import difflib

    near = difflib.get_close_matches(given, list(known), n=1, cutoff=0.5)
    return f"did you mean {prefix}{near[0]}?" if near else "use one of those."


def resolve(name: str, overrides: list[str]) -> RunConfig:
    """The run a command line asks for, in one place: the recipe's scale, then its system (from
    `SCALE-SYSTEM` or a `system=NAME` override, which reconfigures the routing exactly as the
    recipe suffix does), then every other `key=value` override in order."""
    from .config import apply_overrides

    systems = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == "system"]
    if systems:
        scale, _, named = name.partition("-")
        if named and named != systems[-1]:
            raise ConfigError(f"recipe {name!r} names system {named!r} but an override asks for system={systems[-1]!r}. "
                              f"Fix: use one of them, e.g. --recipe {scale}-{systems[-1]}")
        name = scale if systems[-1] == "triroute" else f"{scale}-{systems[-1]}"
    run = get_recipe(name)
    return apply_overrides(run, [o for o in overrides if o.split("=", 1)[0] != "system"])
