"""Load a training checkpoint for evaluation: the engine's model, the run's config, its tokenizer.

The tokenizer and token tables come from the run's recorded data directory (`data.path`,
relative to where the run started), or `data` when given, as in `megatron_triroute.generate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..input_errors import InputError


class EvaluationSetupError(InputError, ValueError):
    """The checkpoint or its data cannot be evaluated; the message names the fix."""


@dataclass
class Loaded:
    model: object
    """The `InferenceModel` (eval mode, priced noise-free decisions)."""
    tree: dict
    """The run's resolved config as the checkpoint records it."""
    step: int
    step_path: Path
    layout: dict
    """The layout that wrote the checkpoint (world_size, tp, pp, ep, dp)."""
    data: Path
    eod: int
    processor: object
    """The run's sentencepiece processor."""
    prices: dict
    """The checkpoint's prices record (inference/prices.py): whether the model's prices are calibrated."""
    dual: dict
    """The budget's dual variables as saved (what a price calibration reads)."""


def load_for_evaluation(checkpoint: str | Path, data: str | Path | None = None) -> Loaded:
    from data_prep.tables import load_token_tables
    from data_prep.tokenizer import load_processor, tokenizer_path

    from ..checkpoint.store import latest_valid_checkpoint, split_step_dir
    from ..inference.checkpoint import build_model, read_inference_checkpoint
    from ..inference.prices import read_prices_record

    path = Path(checkpoint)
    if split_step_dir(path)[1] is not None:
        step_path = path
    else:
        if not path.is_dir():
            raise EvaluationSetupError(f"{path} is not a directory. Fix: pass a run's checkpoint root "
                                       "(RUN/checkpoints) or one of its step_* directories.")
        info = latest_valid_checkpoint(path)
        if info is None:
            raise EvaluationSetupError(f"no checkpoint under {path}. Fix: pass a run's checkpoint root "
                                       "(RUN/checkpoints) or one of its step_* directories.")
        step_path = info.path  # pinned, so the weights and the meta below are of one step
    checkpoint = read_inference_checkpoint(step_path)
    tree, state, meta = checkpoint.tree, checkpoint.state, checkpoint.meta
    data = Path(data) if data is not None else Path(tree["data"]["path"])
    tables_file = data / "tokenizer" / "token_tables.safetensors"
    if not tables_file.exists():
        raise EvaluationSetupError(
            f"{tables_file} not found: the data directory {str(data)!r} (the run's recorded data.path unless "
            "given) is not reachable here. Fix: run from where the run started, or pass --data DIR (data=DIR "
            "in lm_eval's model_args), the run's data_prep output.")
    _, _, eod = load_token_tables(tables_file)
    model = build_model(tree, state, eod)
    return Loaded(model, tree, int(meta["step"]), step_path, dict(meta.get("layout", {})), data, eod,
                  load_processor(tokenizer_path(data)), read_prices_record(meta, model.prices), checkpoint.dual)
