"""Sharded, verified, crash-safe checkpoints of arbitrary tensor trees (see store.py for the layout)."""

from .rng import capture_rng_state, restore_rng_state
from .store import (
    CheckpointError,
    CheckpointInfo,
    CheckpointNotFoundError,
    NoVerifiedCheckpointError,
    latest_valid_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_shards,
    save_checkpoint,
)

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "NoVerifiedCheckpointError",
    "capture_rng_state",
    "latest_valid_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_shards",
    "restore_rng_state",
    "save_checkpoint",
]
