"""Checkpoint -> Hugging Face directory.

    load (any TP/PP/EP layout, one process, no torch.distributed) -> check complete -> write a
    temporary sibling directory -> rename it onto --output.

TriRoute (and every routed system) exports as `model_type: "triroute"` with remote code (the
engine's own modules); Dense exports as a native `LlamaForCausalLM` (llama.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import TriRouteConfig
from .completeness import ExportError, check_complete, expected_tensors
from .safetensors_io import DTYPES, write_weights

log = logging.getLogger("megatron_triroute.export")

HF_PREFIX = "model."
"""`TriRouteForCausalLM` holds the engine's `InferenceModel` as `.model`: HF name = prefix + engine name."""


@dataclass
class ExportSource:
    """What an export reads: one verified checkpoint step and the run's tokenizer."""

    path: Path
    """The `step_*` directory read (a second read, for --calibrate, pins this one)."""
    step: int
    tree: dict
    config: TriRouteConfig
    state: dict[str, torch.Tensor]
    """Engine names -> tensors."""
    eod: int
    model_file: Path
    """The run's sentencepiece model."""
    prices: dict
    """The checkpoint's prices record (inference/prices.py)."""


def read_export_source(checkpoint: Path, data: Path | None) -> ExportSource:
    from ..inference.checkpoint import InferenceCheckpointError, read_inference_checkpoint
    from ..inference.prices import read_prices_record
    from ..vocab import VocabError, load_token_tables, run_vocab_files

    log.info("reading %s", checkpoint)
    try:
        loaded = read_inference_checkpoint(checkpoint, copy=False)  # views: the model held once
        config = TriRouteConfig.from_dict(loaded.tree["triroute"]).validate()
        data = Path(data) if data is not None else Path(loaded.tree.get("data", {}).get("path", ""))
        model_file, tables = run_vocab_files(data, "run from where the run started, or pass --data DIR (the "
                                             "data_prep output the run trained on)")
        _, _, eod = load_token_tables(tables)
    except (InferenceCheckpointError, VocabError) as error:
        raise ExportError(f"{str(error).rstrip('.')}. Nothing was written.") from error
    return ExportSource(loaded.path, loaded.step, loaded.tree, config, loaded.state, eod, model_file,
                        read_prices_record(loaded.meta, loaded.state["prices"]))


def is_dense(config: TriRouteConfig) -> bool:
    r = config.router
    return (r.kind == "triroute" and not r.attn_routing and not r.expert_routing and not r.bit_routing
            and r.uniform_bits == 16)


def export(checkpoint: Path, output: Path, dtype: str = "fp32", max_shard_size: int = 5 * 10**9,
           data: Path | None = None, native: bool = True, calibrate: bool = False, price_curve: bool = False) -> Path:
    """Write the Hugging Face directory `output` (refused if it exists); returns it. `calibrate`:
    calibrate the deployed prices first (evaluation/calibration.py) and export those.
    `price_curve`: put the price curve (inference/serve_budget.py) in the prices record, sampled on
    the run's training batches when the checkpoint carries none, for the modeling code's
    per-request `target_flops`/`target_mem`."""
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: choose one of {sorted(DTYPES)}")
    output = Path(output)
    if output.exists():
        raise ExportError(f"{output} already exists. Fix: pass a new --output directory (or remove it).")
    source = read_export_source(checkpoint, data)
    config, eod = source.config, source.eod
    check_complete(config, source.state)
    state, prices = _served_prices(source, data, calibrate, price_curve)
    tree = dict(source.tree, training_step=source.step)
    log.info("complete: %d tensors (%d layers%s)", len(state), config.model.n_layers,
             f", {config.router.num_experts} experts each" if config.router.expert_routing else "")
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        from .tokenizer import write_tokenizer

        write_tokenizer(tmp, source.model_file, eod, config.model.seq_len)  # first: it checks the EOD id
        if native and is_dense(config):
            from .llama import write_llama

            hf_config = write_llama(tmp, tree, config, state, eod, DTYPES[dtype], max_shard_size, prices)
        else:
            hf_config = write_triroute(tmp, tree, config, state, eod, DTYPES[dtype], max_shard_size, prices)
        write_json(tmp / "config.json", hf_config)
        write_json(tmp / "generation_config.json", {"eos_token_id": eod, "pad_token_id": eod, "do_sample": False})
        for file in tmp.iterdir():
            os.chmod(file, 0o644)
        os.chmod(tmp, 0o755)
        os.rename(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported %s -> %s", checkpoint, output)
    return output


def _served_prices(source: ExportSource, data: Path | None, calibrate: bool,
                   price_curve: bool = False) -> tuple[dict, dict]:
    """(state, prices record) to export: the checkpoint's, or with `calibrate` freshly calibrated
    ones (the same step loaded a second time, as the evaluation tools load it), with `price_curve`
    the price curve in the record; an export of uncalibrated prices is warned about."""
    from ..inference.prices import is_priced, price_warning

    config, state, prices = source.config, source.state, source.prices
    wanted = [flag for flag, on in (("--calibrate", calibrate), ("--price-curve", price_curve)) if on]
    if wanted and is_priced(config) and (calibrate or (prices or {}).get("curve") is None):
        from ..evaluation.calibration import calibrate_loaded, curve_loaded
        from ..evaluation.loading import EvaluationSetupError, load_for_evaluation

        try:
            loaded = load_for_evaluation(source.path, data)
            if calibrate:
                calibrate_loaded(loaded)
            if price_curve:
                curve_loaded(loaded)
        except (EvaluationSetupError, FileNotFoundError) as error:
            raise ExportError(f"{' '.join(wanted)}: {error} Nothing was written.") from error
        state, prices = dict(state, prices=loaded.model.prices.clone()), loaded.prices
    message = price_warning(config, prices, source.step, "pass --calibrate")
    if message is not None:
        log.warning("warning: %s", message)
    return state, prices


def engine_cast(config: TriRouteConfig, dtype: torch.dtype):
    """Parameters go to `dtype`; buffers (prices, token tables, running statistics) keep theirs."""
    expected = expected_tensors(config)
    from ..inference.model import InferenceModel

    with torch.device("meta"):
        params = {HF_PREFIX + n for n, _ in InferenceModel(config).named_parameters()}

    def cast(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name in params:
            return tensor.to(dtype)
        return tensor.to(expected[name[len(HF_PREFIX):]][1])

    return cast


def write_triroute(directory: Path, tree: dict, config: TriRouteConfig, state: dict, eod: int, dtype: torch.dtype,
                   max_shard_size: int, prices: dict | None = None) -> dict:
    """The remote code and the weights into `directory`; returns the config.json to write beside them."""
    from .remote_code import remote_code_files

    for name, source in remote_code_files().items():
        (directory / name).write_text(source)
    tensors = {HF_PREFIX + k: v for k, v in state.items()}
    write_weights(directory, tensors, max_shard_size, engine_cast(config, dtype))
    (directory / "README.md").write_text(model_card(config, prices))
    m = config.model
    return {
        "architectures": ["TriRouteForCausalLM"],
        "model_type": "triroute",
        "auto_map": {"AutoConfig": "configuration_triroute.TriRouteConfig",
                     "AutoModelForCausalLM": "modeling_triroute.TriRouteForCausalLM"},
        "triroute": config.to_dict(),
        "eod_token_id": eod, "eos_token_id": eod, "pad_token_id": eod,
        "vocab_size": m.vocab_size, "hidden_size": m.d_model, "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads, "max_position_embeddings": m.seq_len,
        "tie_word_embeddings": False,
        "dtype": "float32",
        "page_size": 16,
        "storage_dtype": str(dtype).replace("torch.", ""),
        "training_config": {k: v for k, v in tree.items() if k != "training_step"},
        "training_step": tree["training_step"],
        "prices": prices,
    }


def model_card(config: TriRouteConfig, prices: dict | None) -> str:
    """The export's README.md: how to load it and, for a budgeted TriRoute model, how to serve it at
    other budgets (inference/serve_budget.py)."""
    b = config.budget
    lines = ["# TriRoute model (exported by megatron_triroute)", "",
             "```python",
             "from transformers import AutoModelForCausalLM, AutoTokenizer",
             "model = AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)",
             "tok = AutoTokenizer.from_pretrained(DIR, trust_remote_code=True)",
             "out = model.generate(**tok(\"The history of\", return_tensors=\"pt\"), max_new_tokens=32,",
             "                     return_dict_in_generate=True)",
             "model.realised_cost(out.past_key_values)  # realised FLOPs / KV-memory fractions of dense",
             "```", ""]
    if config.router.kind == "triroute" and b.enabled:
        lines += ["## Budget", "",
                  f"Trained and calibrated for FLOPs {b.flops_target} and KV memory {b.mem_target} of the dense "
                  "model (attention reads + experts; KV bytes against a 16-bit cache).", ""]
        curve = (prices or {}).get("curve")
        if curve is None:
            lines += ["This export carries no price curve, so it serves only that budget (re-export with "
                      "`--price-curve` to serve others).", ""]
        else:
            flops, mem = (f"{min(curve[k]):.3f} to {max(curve[k]):.3f}" for k in ("flops", "mem"))
            lines += ["Any other budget, per sequence, without retraining: `model.generate(..., target_flops=F, "
                      "target_mem=M)` (a number, or a list with one per row; None keeps the model's own). Each "
                      "row's prices come from the price curve in `config.prices[\"curve\"]` and are corrected "
                      "from the row's running realised cost; `realised_cost(cache)[\"sequences\"]` gives each "
                      "row's realised fractions over its generated tokens.",
                      f"Reachable: FLOPs {flops}, KV memory {mem}; a target below that range raises ValueError.", ""]
    return "\n".join(lines)


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
