"""torch DCP's files read with nothing unpickled freely and every bad file named.

torch DCP stores a sharded checkpoint's metadata pickled. `read_metadata` reads it through a
restricted unpickler that admits only the metadata classes below (anything else raises
`CheckpointError`). `AllowListedReader` is torch DCP's file reader with that metadata read, done
once, and every data file checked against it, so a truncated `.distcp` is refused by name before any
tensor is read; `reading(directory)` turns what a damaged file raises while the tensors are read (end
of file, a broken archive) into a `CheckpointError` naming the directory and the fix.

Standard library and torch only, no Megatron: a one-process read of a checkpoint's tensors
(`sharded.stored_tensors`) and Megatron's model load (`safe_load.py`) both read through it.
"""

from __future__ import annotations

import contextlib
import io
import pickle
from pathlib import Path
from typing import Any, Iterator

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .store import CheckpointError

FIX = ("Fix: copy the checkpoint again from where it was written, or load an earlier step_* directory "
       "(a run's checkpoints/ root falls back to the newest one that verifies)")
"""What to do about a damaged checkpoint file."""

METADATA_FILE = ".metadata"
"""torch DCP's metadata (rank 0, written once every rank's data files are)."""

_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.planner", "LoadItemType"), ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"), ("torch.distributed.checkpoint.planner", "SavePlan"),
    ("torch.distributed.checkpoint.planner", "WriteItem"), ("torch.distributed.checkpoint.planner", "TensorWriteData"),
    ("torch", "Size"), ("torch", "float32"), ("torch", "float64"), ("torch", "float16"), ("torch", "bfloat16"),
    ("torch", "int64"), ("torch", "int32"), ("torch", "int16"), ("torch", "int8"), ("torch", "uint8"),
    ("torch", "bool"), ("torch", "strided"), ("torch", "contiguous_format"), ("torch", "preserve_format"),
    ("torch", "channels_last"), ("torch", "channels_last_3d"), ("torch", "sparse_coo"),
    ("builtins", "set"), ("builtins", "frozenset"), ("collections", "OrderedDict"), ("enum", "Enum"),
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED_GLOBALS:
            raise CheckpointError(
                f"checkpoint metadata refers to {module}.{name}, which is not on the allow-list of "
                "torch DCP metadata classes: refusing to unpickle it")
        return super().find_class(module, name)


def read_metadata(directory: str | Path):
    """torch DCP metadata of a sharded checkpoint, through the restricted unpickler."""
    path = Path(directory) / METADATA_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: not a complete sharded checkpoint")
    return _RestrictedUnpickler(io.BytesIO(path.read_bytes())).load()


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
