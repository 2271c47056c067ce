"""Megatron-Core's sharded load with nothing unpickled freely and every bad file named.

Megatron-Core 0.16.1's common-state load calls `torch.load` on `common.pt` relying on torch's
default `weights_only`, and its torch_dist strategy builds torch DCP's reader, whose
`read_metadata` unpickles `.metadata` with `pickle.load`. A model load goes through:

- `AllowListedTorchDistLoad`: Megatron's torch_dist load strategy reading through
  `dcp_metadata.AllowListedReader` (the allow-listed metadata read, done once, data files checked);
- `WeightsOnlyCommonLoad`: Megatron's common-state load with `weights_only=True` stated.

This module imports Megatron, so `sharded.py` imports it only when it loads a live model; a read
of the tensors in one process (`sharded.full_model_state`) needs only `dcp_metadata`.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from megatron.core.dist_checkpointing.strategies import torch as megatron_torch
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME, TorchCommonLoadStrategy

from .dcp_metadata import FIX, AllowListedReader
from .store import CheckpointError


class WeightsOnlyCommonLoad(TorchCommonLoadStrategy):
    """Megatron's common-state load (`common.pt`) with `weights_only=True`: tensors and plain
    containers only, whatever torch's default."""

    def load_common(self, checkpoint_dir: str | Path):
        path = Path(checkpoint_dir) / COMMON_STATE_FNAME
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: not a complete sharded checkpoint. {FIX}.")
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as error:
            reason = str(error).strip().splitlines()[0]
            raise CheckpointError(f"{path} holds more than tensors and plain containers ({reason}): refusing to "
                                  f"unpickle it. {FIX}.") from None


class AllowListedTorchDistLoad(megatron_torch.TorchDistLoadShardedStrategy):
    """Megatron-Core's torch_dist load strategy reading through `reader` (an `AllowListedReader` of
    the checkpoint directory). Megatron's `load` builds its reader with the module function
    `_get_filesystem_reader` and takes no reader argument, so that function is replaced for the
    duration of this load only; the rest is Megatron's own `load`."""

    def __init__(self, reader: AllowListedReader) -> None:
        super().__init__()
        self.reader = reader

    def load(self, sharded_state_dict, checkpoint_dir):
        from unittest import mock

        if Path(self.reader.path) != Path(checkpoint_dir):
            raise ValueError(f"the reader reads {self.reader.path}, the load asks for {checkpoint_dir}")
        with mock.patch.object(megatron_torch, "_get_filesystem_reader", lambda *args, **kwargs: self.reader):
            return super().load(sharded_state_dict, checkpoint_dir)
