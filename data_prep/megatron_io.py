"""The only module that touches Megatron-Core: writing and reading indexed datasets.

Datasets are written with `IndexedDatasetBuilder` (one sequence per document, as Megatron's
own `tools/preprocess_data.py` does without sentence splitting), so `IndexedDataset`,
`GPTDataset` and `BlendedMegatronDatasetBuilder` read them. Megatron imports take seconds, so
the import is deferred until a dataset is actually written or read.
"""

from __future__ import annotations

import gc
import warnings
from pathlib import Path

import numpy as np

from data_prep.atomic import TMP_MARK, publish_file

_module = None


def _indexed_dataset_module():
    global _module
    if _module is None:
        with warnings.catch_warnings():
            # megatron.core warns at import that Transformer Engine / Apex are absent; irrelevant here.
            warnings.simplefilter("ignore")
            from megatron.core.datasets import indexed_dataset
        # `add_index` calls gc.collect() on every concatenation; with torch's millions of import-time
        # objects each call took ~0.2 s. Freezing them (they live for the whole process anyway)
        # takes them out of every later collection.
        gc.freeze()
        _module = indexed_dataset
    return _module


def token_dtype(vocab_size: int) -> type:
    """Megatron's own choice: uint16 when ids fit below 65500, else int32."""
    return _indexed_dataset_module().DType.optimal_dtype(vocab_size)


class DatasetWriter:
    """Writes `<prefix>.bin/.idx` document by document. Use inside a directory that is published
    atomically as a whole, or call `publish()` to rename temporary files into place."""

    def __init__(self, prefix: Path, dtype: type, temporary: bool = False):
        self.prefix = prefix
        self.suffix = f"{TMP_MARK}write" if temporary else ""
        self.documents = 0
        """Documents added with `add` (not counting appended datasets)."""
        self.tokens = 0
        module = _indexed_dataset_module()
        self._builder = module.IndexedDatasetBuilder(str(prefix) + ".bin" + self.suffix, dtype=dtype)

    def add(self, tokens: np.ndarray) -> None:
        self._builder.add_document(tokens, [len(tokens)])
        self.documents += 1
        self.tokens += len(tokens)

    def append_dataset(self, prefix: Path) -> None:
        """Concatenate another dataset of the same dtype (Megatron's `add_index`). The callers know
        the part's sizes from its stats, so `documents`/`tokens` are not updated here."""
        self._builder.add_index(str(prefix))

    def finish(self) -> None:
        self._builder.finalize(str(self.prefix) + ".idx" + self.suffix)
        if self.suffix:
            for ext in (".bin", ".idx"):
                publish_file(Path(str(self.prefix) + ext + self.suffix), Path(str(self.prefix) + ext))


def remove_dataset(prefix: Path) -> None:
    for ext in (".bin", ".idx"):
        Path(str(prefix) + ext).unlink(missing_ok=True)


def open_dataset(prefix: Path):
    """Megatron's reader (`IndexedDataset`), for checks and tests."""
    return _indexed_dataset_module().IndexedDataset(str(prefix))
