"""Merge step 1: exact dedup across all shards and the train/validation split.

Which copy of a duplicate is kept: the first occurrence in canonical order, i.e. ordered by
(shard path, record number). This order is fixed by the inputs alone, so the kept copy does not
depend on the worker count, on which shard finished first, or on a resume. The "seen" set is
the per-shard hash lists the parse stage persisted (`work/parsed/*/index.npy`), so it survives
resumes and spans every task of a Slurm array.

Each accepted document gets one code, saved per shard as `work/assign/<shard_id>.npy`:
DUPLICATE (dropped), TRAIN or VALID (`doc_hash.is_validation`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_prep.atomic import write_npy_atomic
from data_prep.doc_hash import HASH_BYTES, is_validation
from data_prep.inputs import Shard
from data_prep.parse_stage import load_index

DUPLICATE, TRAIN, VALID = 0, 1, 2


@dataclass
class Assignment:
    codes: list[np.ndarray]
    """Per shard (canonical order), one uint8 code per accepted document, in input order."""

    def count(self, code: int) -> int:
        return int(sum(int((c == code).sum()) for c in self.codes))


def assign_path(work: Path, shard: Shard) -> Path:
    return work / "assign" / f"{shard.shard_id}.npy"


def assign_documents(work: Path, shards: list[Shard], valid_fraction: float, seed: int) -> Assignment:
    indexes = [load_index(work, shard) for shard in shards]
    hashes = np.concatenate([index["hash"] for index in indexes]) if indexes else np.array([], "S16")
    # numpy's unique with return_index sorts stably, so `first` is each hash's first occurrence
    # in the concatenation, which is canonical (shard path, record number) order.
    _, first = np.unique(hashes, return_index=True)
    codes = np.full(len(hashes), DUPLICATE, dtype=np.uint8)
    raw = hash_rows(hashes)
    for position in np.sort(first):
        codes[position] = VALID if is_validation(raw[position].tobytes(), valid_fraction, seed) else TRAIN
    per_shard = np.split(codes, np.cumsum([len(index) for index in indexes])[:-1]) if indexes else []
    for shard, shard_codes in zip(shards, per_shard):
        write_npy_atomic(assign_path(work, shard), shard_codes)
    return Assignment(codes=list(per_shard))


def hash_rows(hashes: np.ndarray) -> np.ndarray:
    """(N, HASH_BYTES) uint8 view of an `S16` hash column. Going through bytes of the raw view
    matters: numpy's `bytes(np.bytes_)` drops trailing NUL bytes, which would change the hash."""
    return np.ascontiguousarray(hashes).view(np.uint8).reshape(-1, HASH_BYTES)
