"""The reader of a model checkpoint in one process: verified, nothing unpickled, config validated.

    read_model_checkpoint(path) -> ModelCheckpoint(path, step, meta, tree, config, state)

`path` is a run's checkpoint root (the newest step that verifies is read; an older one when the
newest does not, as a resume falls back) or one `step_*` directory. Every file is checked against
the step's manifest first (`store.py`); the shards are safetensors with JSON skeletons and torch
DCP's metadata goes through an allow-list (`dcp_metadata.py`), so nothing is unpickled freely. A
layout-independent checkpoint is read whole whatever tensor/pipeline/expert layout wrote it
(`sharded.full_model_state`); the earlier per-rank format only at layout 1/1/1. The state keeps
Megatron's names (`decoder.layers.L.…`); the engine maps them onto its own (`inference/checkpoint.py`).

Inference, evaluation, export and the import's read-back read here, with torch and torch DCP
alone: no Megatron or DeepSpeed import. A training resume loads the same verified step into the
live, sharded model instead (`store.load_checkpoint` + `sharded.load_state`, training/run_state.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import TriRouteConfig
from ..durability import resolve_dir
from .sharded import GLOBAL_FORMAT, current_name, full_model_state, stack_per_expert_names
from .store import (
    EXTRA_DIR, CheckpointError, CheckpointNotFoundError, latest_valid_checkpoint, load_checkpoint, split_step_dir,
    step_dir_name,
)

WHERE = "Fix: pass a run's checkpoint root (RUN/checkpoints) or one of its step_* directories."
"""What to pass instead of a path that holds no checkpoint."""


@dataclass
class ModelCheckpoint:
    path: Path
    """The `step_*` directory read: a caller that reads more of the run pins this one step."""
    step: int
    meta: dict
    """The checkpoint's meta as saved (run config, layout, prices record: inference/prices.py)."""
    tree: dict
    """The run's resolved config tree as saved (`meta["config"]`)."""
    config: TriRouteConfig
    """`tree["triroute"]`, validated."""
    state: dict[str, torch.Tensor]
    """The whole model, Megatron names (a tensor/pipeline/expert 1/1/1 model's `state_dict()`)."""


def read_model_checkpoint(path: str | Path, *, copy: bool = True) -> ModelCheckpoint:
    """The model of the newest verified checkpoint under `path` (a checkpoint root or one `step_*`
    directory), refusing by name what cannot be read. `copy=False` (the exporter's): the tensors of
    a layout-independent checkpoint may be views sharing storage, so the model is held once."""
    path = Path(path)
    root, step = split_step_dir(path)
    if step is None:
        if not path.is_dir():
            raise CheckpointNotFoundError(f"{path} is not a directory. {WHERE}")
        info = latest_valid_checkpoint(path)
        if info is None:
            raise CheckpointNotFoundError(f"no checkpoint under {path}. {WHERE}")
        step = info.step
    step, shard, meta = load_checkpoint(root, rank=0, step=step)
    step_path = resolve_dir(root / step_dir_name(step)) or root / step_dir_name(step)
    tree = meta["config"]
    config = TriRouteConfig.from_dict(tree["triroute"]).validate()
    if meta.get("checkpoint_format") == GLOBAL_FORMAT:  # layout-independent: whatever layout wrote it
        state = full_model_state(step_path / EXTRA_DIR, copy=copy)
    else:
        layout = meta.get("layout", {})
        shape = tuple(layout.get(k) for k in ("tp", "pp", "ep"))
        if shape != (1, 1, 1):
            raise CheckpointError(
                f"{path}: written with tensor/pipeline/expert parallel {shape}; a one-process read takes only "
                "(1, 1, 1) in this earlier per-rank format. Fix: convert the checkpoint to a layout-independent "
                "one first (or train with parallel.tensor=parallel.pipeline=parallel.expert=1).")
        # experts as the model now holds them: stacked per layer
        state = stack_per_expert_names({current_name(k): v for k, v in shard["model"].items()})
    return ModelCheckpoint(step_path, step, meta, tree, config, state)
