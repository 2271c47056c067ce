"""Reading a sharded checkpoint's files with nothing unpickled freely and every bad file named.

torch DCP's `FileSystemReader.read_metadata` unpickles `.metadata` with `pickle.load`, and
Megatron-Core 0.16.1's common-state load calls `torch.load` on `common.pt` relying on torch's
default `weights_only`. Both loads here go through:

- `AllowListedReader`: torch DCP's reader whose metadata read is the allow-listed one
  (`dcp_metadata.read_metadata`), done once; it also checks that every data file is at least as long as
  the metadata says, so a truncated `.distcp` is refused by name before any tensor is read;
- `AllowListedTorchDistLoad`: Megatron's torch_dist load strategy reading through that reader;
- `WeightsOnlyCommonLoad`: Megatron's common-state load with `weights_only=True` stated.

`reading(directory)` turns what a damaged file raises while the tensors are read (end of file, a
broken archive) into a `CheckpointError` naming the directory and the fix. This module imports
torch DCP and Megatron, so `sharded.py` imports it only when it loads.
"""

from __future__ import annotations

import contextlib
import pickle
from pathlib import Path
from typing import Iterator

import torch
from megatron.core.dist_checkpointing.strategies import torch as megatron_torch
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME, TorchCommonLoadStrategy
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .dcp_metadata import read_metadata
from .store import CheckpointError

FIX = ("Fix: copy the checkpoint again from where it was written, or load an earlier step_* directory "
       "(a run's checkpoints/ root falls back to the newest one that verifies)")
"""What to do about a damaged checkpoint file."""


def storage_problems(directory: str | Path, metadata: Metadata) -> list[str]:
    """Each data file the metadata places tensor bytes in that is missing or shorter than the last
    byte placed in it."""
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, end in sorted(ends.items()):
        path = Path(directory) / name
        if not path.is_file():
            problems.append(f"{path} is missing (the checkpoint's metadata places tensor data in it)")
        elif path.stat().st_size < end:
            problems.append(f"{path} is {path.stat().st_size} bytes, but the checkpoint's metadata places tensor "
                            f"data up to byte {end}: the file is truncated")
    return problems


class AllowListedReader(FileSystemReader):
    """torch DCP's file reader with `.metadata` read through the allow-list, once (Megatron asks for
    it again after loading), and the data files checked against it."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._metadata is None:
            metadata = read_metadata(self.path)
            problems = storage_problems(self.path, metadata)
            if problems:
                raise CheckpointError("; ".join(problems) + f". {FIX}.")
            if getattr(metadata, "storage_meta", None) is None:  # as torch's own read_metadata does
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            self._metadata = metadata
        return self._metadata


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


@contextlib.contextmanager
def reading(directory: str | Path) -> Iterator[None]:
    """What a damaged data file raises while tensors are read, as a CheckpointError naming the
    directory and the fix (torch DCP gathers a rank's failure into a CheckpointException)."""
    try:
        yield
    except CheckpointError:
        raise
    except CheckpointException as error:  # a CheckpointError of ours raised inside torch DCP comes out as is
        inner = [f[0] if isinstance(f, tuple) else f for f in error.failures.values()]
        ours = next((e for e in inner if isinstance(e, CheckpointError)), None)
        if ours is not None:
            raise ours from None
        raise CheckpointError(f"{directory}: cannot read the checkpoint's tensor data ({error}). {FIX}.") from error
    except (EOFError, OSError, pickle.UnpicklingError) as error:
        raise CheckpointError(f"{directory}: cannot read the checkpoint's tensor data "
                              f"({type(error).__name__}: {str(error).strip()[:300]}). {FIX}.") from error
