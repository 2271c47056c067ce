"""Read a training checkpoint for inference: config tree + the engine's name -> tensor state dict.

The checkpoint is read by `checkpoint/reader.py` (verified against its manifest, nothing
unpickled, any tensor/pipeline/expert layout of the layout-independent format). Megatron names
map onto `InferenceModel`'s:

    embedding.word_embeddings.weight                -> embed.weight
    decoder.layers.L.self_attention.linear_qkv      -> layers.L.wq / wk / wv   (per KV group:
                                                        [G query heads | k | v], d_h rows each)
    decoder.layers.L.self_attention.linear_proj     -> layers.L.wo  (D, H, d_h)
    decoder.layers.L.{input,pre_mlp}_layernorm      -> layers.L.{attn,ffn}_norm
    decoder.layers.L.mlp.experts.moe.experts.w{1,2,3} (E, ...) -> layers.L.experts.E.w{1,2,3}  (each expert of the stack)
    decoder.layers.L.mlp.mlp.linear_fc1 / fc2       -> layers.L.ffn.w1, w3 (gate | up halves) / w2
    decoder.layers.L.controller.*                   -> layers.L.controller.*  (whitening and
                                                        gradient-balance running statistics included)
    decoder.final_layernorm.weight, output_layer.weight -> final_norm.weight, lm_head.weight
    budget.prices                                   -> prices   (zero when absent)
    token_log_prob, token_word_start                -> the same names
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import TriRouteConfig
from ..input_errors import InputError

IGNORED = ("budget.targets", "budget.lambdas", "budget.ema", "budget.steps")
"""Training-only buffers: the dual variables are not part of the deployed policy (the prices are)."""
TRAINING_ONLY_LAYER = "reward_baseline."
"""A layer's training-only buffers (the REINFORCE estimator's reward baseline): not served."""


class InferenceCheckpointError(InputError, ValueError):
    """The checkpoint cannot be served; the message names what is wrong and the fix."""


@dataclass
class InferenceCheckpoint:
    path: Path
    """The `step_*` directory read."""
    tree: dict
    """The config tree as saved by the run."""
    state: dict[str, torch.Tensor]
    """`InferenceModel` names -> tensors."""
    step: int
    meta: dict
    """The checkpoint's meta (its `prices` record: inference/prices.py)."""
    dual: dict[str, torch.Tensor]
    """The budget's training-only dual variables (`lambdas`, `ema`, `steps`; those present): what
    a price calibration reads to tell active constraints (training/calibrate.py)."""


def load_inference_checkpoint(path: str | Path, *, copy: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config tree as saved by the run, state dict in `InferenceModel` names) of the newest valid
    checkpoint under `path` (a run's checkpoint root, or one `step_*` directory of it). `copy=False`
    (the exporter's): tensors of a layout-independent checkpoint may be views sharing storage, so
    the model is held once."""
    loaded = read_inference_checkpoint(path, copy=copy)
    return loaded.tree, loaded.state


def read_inference_checkpoint(path: str | Path, *, copy: bool = True) -> InferenceCheckpoint:
    """`load_inference_checkpoint` with the step directory read, its step, meta and budget dual variables."""
    from ..checkpoint.reader import read_model_checkpoint
    from ..checkpoint.store import CheckpointError

    try:
        read = read_model_checkpoint(path, copy=copy)
    except CheckpointError as error:
        raise InferenceCheckpointError(str(error)) from error
    state = read.state
    dual = {k[len("budget."):]: state[k].clone() for k in IGNORED if k in state and k != "budget.targets"}
    return InferenceCheckpoint(read.path, read.tree, map_megatron_state(state, read.config), read.step, read.meta,
                               dual)


def map_megatron_state(state: dict[str, torch.Tensor], config: TriRouteConfig) -> dict[str, torch.Tensor]:
    """Megatron/DeepSpeed names -> `InferenceModel` names (module docstring), checking that every
    expected tensor is present exactly once with the right shape; refuses otherwise."""
    m, r = config.model, config.router
    state = {k: v for k, v in state.items() if not k.endswith("_extra_state")}
    used: set[str] = set()
    problems: list[str] = []

    def take(name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor | None:
        if name not in state:
            problems.append(f"missing {name}")
            return None
        used.add(name)
        t = state[name]
        if shape is not None and tuple(t.shape) != tuple(shape):
            problems.append(f"{name} has shape {tuple(t.shape)}, the config implies {tuple(shape)}")
            return None
        return t

    D, H, Hkv, d, V = m.d_model, m.n_heads, m.n_kv_heads, m.d_head, m.vocab_size
    G = H // Hkv
    out: dict[str, torch.Tensor] = {}
    out["embed.weight"] = take("embedding.word_embeddings.weight", (V, D))
    out["final_norm.weight"] = take("decoder.final_layernorm.weight", (D,))
    out["lm_head.weight"] = take("output_layer.weight", (V, D))
    out["token_log_prob"] = take("token_log_prob", (V,))
    out["token_word_start"] = take("token_word_start", (V,))
    out["prices"] = take("budget.prices", (2,)) if "budget.prices" in state else torch.zeros(2, dtype=torch.float64)
    used.update(k for k in IGNORED if k in state)

    from ..routing.cost import expert_width

    for L in range(m.n_layers):
        src, dst = f"decoder.layers.{L}.", f"layers.{L}."
        used.update(k for k in state if k.startswith(src + TRAINING_ONLY_LAYER))  # REINFORCE's baseline
        qkv = take(src + "self_attention.linear_qkv.weight", ((H + 2 * Hkv) * d, D))
        if qkv is not None:
            grouped = qkv.view(Hkv, G + 2, d, D)  # Megatron's per-KV-group layout
            out[dst + "wq"] = grouped[:, :G].reshape(H, d, D)
            out[dst + "wk"] = grouped[:, G]
            out[dst + "wv"] = grouped[:, G + 1]
        proj = take(src + "self_attention.linear_proj.weight", (D, H * d))
        if proj is not None:
            out[dst + "wo"] = proj.view(D, H, d)
        out[dst + "attn_norm.weight"] = take(src + "input_layernorm.weight", (D,))
        out[dst + "ffn_norm.weight"] = take(src + "pre_mlp_layernorm.weight", (D,))
        if r.expert_routing:
            w = expert_width(m, r)
            for name, shape in (("w1", (w, D)), ("w3", (w, D)), ("w2", (D, w))):  # stacked over the experts
                stacked = take(f"{src}mlp.experts.moe.experts.{name}.weight", (r.num_experts, *shape))
                for e in range(r.num_experts):
                    out[f"{dst}experts.{e}.{name}.weight"] = None if stacked is None else stacked[e]
        else:
            fc1 = take(src + "mlp.mlp.linear_fc1.weight", (2 * m.d_ff, D))
            if fc1 is not None:
                out[dst + "ffn.w1.weight"], out[dst + "ffn.w3.weight"] = fc1[: m.d_ff], fc1[m.d_ff :]
            out[dst + "ffn.w2.weight"] = take(src + "mlp.mlp.linear_fc2.weight", (D, m.d_ff))
        prefix = src + "controller."
        for name in sorted(k for k in state if k.startswith(prefix)):
            out[dst + "controller." + name[len(prefix):]] = take(name)
    unexpected = sorted(set(state) - used)
    if unexpected:
        problems.append(f"unexpected tensors {unexpected[:6]}{' ...' if len(unexpected) > 6 else ''}")
    if problems:
        raise InferenceCheckpointError(
            "checkpoint does not match the config it records: " + "; ".join(problems[:8])
            + ". Fix: serve the checkpoint with the run config it was trained with.")
    return {k: v for k, v in out.items() if v is not None}


def build_model(tree: dict, state: dict[str, torch.Tensor], eod_id: int):
    """The `InferenceModel` of a loaded checkpoint (`eod_id` from the run's tokenizer tables), its
    weights on huge pages where the kernel offers them (`huge_pages.place_on_huge_pages`: the engine
    serves on the CPU, where a decode step streams them)."""
    from ..routing.side_features import TokenTables
    from .huge_pages import place_on_huge_pages
    from .model import InferenceModel

    config = TriRouteConfig.from_dict(tree["triroute"]).validate()
    tables = TokenTables(state["token_log_prob"], state["token_word_start"].bool(), eod_id)
    model = InferenceModel(config, tables)
    load_state(model, state)
    place_on_huge_pages(model)
    return model


def load_state(model, state: dict[str, torch.Tensor]) -> None:
    """Strict load: a controller tensor the engine expects but the checkpoint lacks (or vice versa) is refused."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise InferenceCheckpointError(
            f"checkpoint tensors do not match the engine's model: missing {missing[:6]}, unexpected {unexpected[:6]}. "
            "Fix: serve the checkpoint with the run config it was trained with.")
