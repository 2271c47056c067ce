"""Hugging Face directory (written by the exporter) -> training checkpoint.

The weights are mapped back to Megatron/DeepSpeed names (the inverse of
`inference.checkpoint.map_megatron_state`, checked by running that map on the result: it must
give back exactly the exported tensors, bit for bit) and written as a layout-independent,
weights-only checkpoint whose meta holds the run config recorded in the export: a new run starts
from it at any layout with `train.init_from`. The training-only budget dual variables (lambdas, EMA)
are not part of an export; the import keeps their initial values.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from ..config import TriRouteConfig
from ..inference.checkpoint import IGNORED
from .completeness import ExportError, check_complete

log = logging.getLogger("megatron_triroute.export")


def engine_to_megatron(config: TriRouteConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    m, r = config.model, config.router
    H, Hkv, d, D = m.n_heads, m.n_kv_heads, m.d_head, m.d_model
    G = H // Hkv
    out = {"embedding.word_embeddings.weight": state["embed.weight"],
           "decoder.final_layernorm.weight": state["final_norm.weight"],
           "output_layer.weight": state["lm_head.weight"],
           "token_log_prob": state["token_log_prob"], "token_word_start": state["token_word_start"],
           "budget.prices": state["prices"]}
    for L in range(m.n_layers):
        s, t = f"layers.{L}.", f"decoder.layers.{L}."
        q = state[s + "wq"].reshape(Hkv, G, d, D)
        grouped = torch.cat([q, state[s + "wk"].unsqueeze(1), state[s + "wv"].unsqueeze(1)], 1)
        out[t + "self_attention.linear_qkv.weight"] = grouped.reshape((H + 2 * Hkv) * d, D)
        out[t + "self_attention.linear_proj.weight"] = state[s + "wo"].reshape(D, H * d)
        out[t + "input_layernorm.weight"] = state[s + "attn_norm.weight"]
        out[t + "pre_mlp_layernorm.weight"] = state[s + "ffn_norm.weight"]
        if r.expert_routing:
            for w in ("w1", "w2", "w3"):  # the layer's experts stacked
                out[f"{t}mlp.experts.moe.experts.{w}.weight"] = \
                    torch.stack([state[f"{s}experts.{e}.{w}.weight"] for e in range(r.num_experts)])
        else:
            out[t + "mlp.mlp.linear_fc1.weight"] = torch.cat([state[s + "ffn.w1.weight"], state[s + "ffn.w3.weight"]])
            out[t + "mlp.mlp.linear_fc2.weight"] = state[s + "ffn.w2.weight"]
        prefix = s + "controller."
        out.update({t + "controller." + k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
    return {k: v.contiguous() for k, v in out.items()}


def read_export(directory: Path) -> tuple[dict, TriRouteConfig, dict[str, torch.Tensor]]:
    """(config.json, config, engine-name state) of an exported directory."""
    from .exporter import HF_PREFIX
    from .safetensors_io import read_weights

    directory = Path(directory)
    cfg_file = directory / "config.json"
    if not cfg_file.is_file():
        raise ExportError(f"{directory}: no config.json. Fix: pass a directory written by the exporter.")
    try:
        hf = json.loads(cfg_file.read_text())
    except ValueError as error:
        raise ExportError(f"{cfg_file} is not JSON ({error}). Fix: copy the directory again from where it was "
                          "exported.") from None
    if not isinstance(hf, dict) or "triroute" not in hf or "training_config" not in hf:
        raise ExportError(f"{cfg_file} has no `triroute`/`training_config` entries: not written by "
                          "megatron_triroute.export, so the run config cannot be recovered. Fix: import a directory "
                          "the exporter wrote.")
    config = TriRouteConfig.from_dict(hf["triroute"]).validate()
    check_halves_agree(cfg_file, hf, config)
    weights = read_weights(directory)
    if hf.get("model_type") == "llama":
        from .llama import SIDE_FILE, llama_to_engine
        from .safetensors_io import read_file

        side_file = directory / SIDE_FILE
        if not side_file.is_file():
            raise ExportError(f"{side_file} is missing: it holds the controller, prices and token tables the "
                              "Llama weights have no place for. Fix: re-export the checkpoint.")
        state = llama_to_engine(config, weights, read_file(side_file))
    elif hf.get("model_type") == "triroute":
        stray = sorted(k for k in weights if not k.startswith(HF_PREFIX))
        if stray:
            raise ExportError(f"{directory}: unexpected tensors {stray[:4]}. Fix: re-export the checkpoint.")
        state = {k[len(HF_PREFIX):]: v for k, v in weights.items()}
    else:
        raise ExportError(f"{cfg_file}: model_type {hf.get('model_type')!r}; the importer reads `triroute` and "
                          "`llama` exports of this project.")
    return hf, config, state


def check_halves_agree(cfg_file: Path, hf: dict, config: TriRouteConfig) -> None:
    """Refuse a config.json whose `triroute` section (the model the weights are read as) and
    `training_config.triroute` (the run config the imported checkpoint records, which a run started
    from it must match) differ, naming every differing key: a hand edit of one half only."""
    from ..training.resume_config import flatten

    recorded = hf["training_config"].get("triroute") if isinstance(hf["training_config"], dict) else None
    if recorded is None:
        raise ExportError(f"{cfg_file}: training_config has no `triroute` section. Fix: import a directory the "
                          "exporter wrote (or restore training_config from the checkpoint's config).")
    model = flatten(config.to_dict())
    run = flatten(TriRouteConfig.from_dict(recorded).validate().to_dict())
    differ = [f"{k}: triroute {model.get(k)!r}, training_config.triroute {run.get(k)!r}"
              for k in sorted(model.keys() | run.keys()) if model.get(k) != run.get(k)]
    if differ:
        raise ExportError(f"{cfg_file}: its `triroute` section and `training_config.triroute` disagree on "
                          f"{len(differ)} key(s):\n  " + "\n  ".join(differ) + "\nFix: make the two halves equal "
                          "(the exporter writes them equal; an edit changed one), or export the checkpoint again.")


TRAINING_ONLY = IGNORED + ("_extra_state", "reward_baseline.value", "reward_baseline.steps")
"""Model state an export does not carry (the budget's dual variables, Megatron's extra state): a
model built from the import keeps their initial values."""


def import_hf(directory: Path, output: Path) -> Path:
    """Write `directory` (an export) as a layout-independent, weights-only checkpoint at `output`:
    a one-process model of the recorded config is built, loaded with the mapped weights and saved
    through the same `dist_checkpointing` path as training, so a run at any layout starts from it
    with `train.init_from`; it is then read back through the checkpoint reader (`check_read_back`)."""
    from ..checkpoint.sharded import GLOBAL_FORMAT, plan_state_save
    from ..checkpoint.store import save_checkpoint
    from ..distributed.one_process import build_model, single_process_parallel
    from ..inference.checkpoint import map_megatron_state

    output = Path(output)
    if output.exists():
        raise ExportError(f"{output} already exists. Fix: pass a new --output directory.")
    hf, config, state = read_export(directory)
    from .completeness import expected_tensors

    expected = expected_tensors(config)
    state = {k: v.to(expected[k][1]) if k in expected else v for k, v in state.items()}  # bf16/fp16 exports
    check_complete(config, state)
    megatron = engine_to_megatron(config, state)
    back = map_megatron_state(megatron, config)
    differ = sorted(k for k in state if not torch.equal(back[k], state[k]))
    if differ or set(back) != set(state):
        raise ExportError(f"internal error: the Megatron names do not map back onto the export ({differ[:4]})")
    step = int(hf.get("training_step") or 0)
    meta = {"step": step, "config": hf["training_config"], "checkpoint_format": GLOBAL_FORMAT, "weights_only": True,
            "layout": {"world_size": 1, "tp": 1, "pp": 1, "ep": 1, "dp": 1}, "imported_from": str(directory)}
    if hf.get("prices") is not None:  # the export's prices record (inference/prices.py)
        meta["prices"] = hf["prices"]
    with single_process_parallel() as groups:
        model = build_model(config, groups)
        missing, unexpected = model.load_state_dict(megatron, strict=False)
        missing = [k for k in missing if not k.endswith(TRAINING_ONLY)]
        if missing or unexpected:
            raise ExportError(f"internal error: the import does not fill the model: missing {missing[:4]}, "
                              f"unexpected {unexpected[:4]}")
        path = save_checkpoint(output, step, {}, meta, write_extra=lambda d: plan_state_save(d, model, None))
    check_read_back(output, config, megatron)
    log.info("imported %s -> %s (%d tensors)", directory, path, len(megatron))
    return output


def check_read_back(output: Path, config: TriRouteConfig, megatron: dict[str, torch.Tensor]) -> None:
    """Read the written checkpoint as every reader reads it (`checkpoint/reader.py`: verified, the
    recorded config validated) and refuse unless it gives back the config and every imported tensor
    bit for bit."""
    from ..checkpoint.reader import read_model_checkpoint

    read = read_model_checkpoint(output, copy=False)
    differ = sorted(k for k, v in megatron.items() if k not in read.state or not torch.equal(read.state[k], v))
    if differ or read.config.to_dict() != config.to_dict():
        raise ExportError(f"internal error: {output} does not read back as imported ({differ[:4] or 'the config'})")
