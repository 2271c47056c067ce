"""torch DCP's `.metadata` read with nothing unpickled freely.

torch DCP stores a sharded checkpoint's metadata pickled. `read_metadata` reads it through a
restricted unpickler that admits only the metadata classes below (anything else raises
`CheckpointError`). Standard library and torch only: `sharded.py` and `safe_load.py` both use it.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

from .store import CheckpointError

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
