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
    """The newest verified checkpoint under `checkpoint` (a root or one `step_*` directory) as the
    engine's model, with the run's tokenizer and tables from `data` (default: the run's data.path)."""
    from ..inference.checkpoint import build_model, read_inference_checkpoint
    from ..inference.prices import read_prices_record
    from ..vocab import load_processor, load_token_tables, run_vocab_files

    checkpoint = read_inference_checkpoint(checkpoint)  # pinned: the weights and the meta are of one step
    tree, meta = checkpoint.tree, checkpoint.meta
    data = Path(data) if data is not None else Path(tree["data"]["path"])
    model_file, tables = run_vocab_files(data, "run from where the run started, or pass --data DIR (data=DIR in "
                                         "lm_eval's model_args), the run's data_prep output")
    _, _, eod = load_token_tables(tables)
    model = build_model(tree, checkpoint.state, eod)
    return Loaded(model, tree, checkpoint.step, checkpoint.path, dict(meta.get("layout", {})), data, eod,
                  load_processor(model_file), read_prices_record(meta, model.prices), checkpoint.dual)
