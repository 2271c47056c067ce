"""Merge step 4, per shard: cut the tail buckets out of the validation documents.

Needs the global rare-entity set, so it runs after every shard is tokenized. It re-encodes
only validation documents (a small fraction) to get each token's byte offsets, applies the
rules of `buckets.py`, and writes per-shard `<bucket>_text_document` and `<bucket>_loss_mask`
datasets to `work/buckets/<shard_id>/`. Cheap, so it is recomputed on every merge rather than
recorded in the manifest.
"""

from __future__ import annotations

import io
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zstandard

from data_prep.buckets import (BUCKETS, char_to_byte_offsets, is_code_document, math_spans, rare_entity_spans,
                               span_mask)
from data_prep.config import BucketConfig
from data_prep.inputs import Shard
from data_prep.megatron_io import DatasetWriter
from data_prep.pool import worker_counters
from data_prep.progress import Tally
from data_prep.tokenize_stage import tokenized_dir


@dataclass(frozen=True)
class BucketTask:
    shard: Shard
    work: str
    tokenizer: str
    eod_id: int
    dtype: str
    buckets: BucketConfig
    rare_keys_file: str
    """`.npy` of the rare entity keys: a file, not a task field, so thousands of tasks do not each
    pickle the whole set."""


def bucket_dir(work: Path, shard: Shard) -> Path:
    return work / "buckets" / shard.shard_id


def iter_valid_docs(work: Path, shard: Shard):
    with open(tokenized_dir(work, shard) / "valid_docs.jsonl.zst", "rb") as raw:
        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        for line in io.TextIOWrapper(reader, encoding="utf-8"):
            yield json.loads(line)


def scored_masks(text: str, domain: str, begins: np.ndarray, ends: np.ndarray, config: BucketConfig,
                 rare_keys) -> dict[str, np.ndarray]:
    """Per bucket, the 0/1 mask over the document's tokens (EOD excluded) when it is non-empty."""
    n_tokens = len(begins)
    masks: dict[str, np.ndarray] = {}
    if is_code_document(text, domain, config):
        masks["code"] = np.ones(n_tokens, dtype=np.uint8)
    else:
        to_bytes = char_to_byte_offsets(text)
        for name, spans in (("rare_entity", rare_entity_spans(text, rare_keys)), ("math", math_spans(text, config))):
            if spans:
                masks[name] = span_mask(begins, ends, [(int(to_bytes[a]), int(to_bytes[b])) for a, b in spans])
    if n_tokens > config.long_context_min_tokens:
        mask = np.zeros(n_tokens, dtype=np.uint8)
        mask[config.long_context_min_tokens:] = 1
        masks["long_context"] = mask
    return {name: mask for name, mask in masks.items() if mask.any()}


def run(task: BucketTask) -> dict:
    import sentencepiece

    work, shard = Path(task.work), task.shard
    out = bucket_dir(work, shard)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    tally = Tally(worker_counters())
    processor = sentencepiece.SentencePieceProcessor(model_file=task.tokenizer)
    rare_keys = set(np.load(task.rare_keys_file).tolist())
    dtype = getattr(np, task.dtype)
    tokens_out = {name: DatasetWriter(out / f"{name}_text_document", dtype) for name in BUCKETS}
    masks_out = {name: DatasetWriter(out / f"{name}_loss_mask", np.uint8) for name in BUCKETS}
    stats = {name: {"documents": 0, "tokens": 0, "scored_tokens": 0} for name in BUCKETS}
    for doc in iter_valid_docs(work, shard):
        pieces = processor.encode(doc["text"], out_type="proto").pieces
        ids = np.array([piece.id for piece in pieces] + [task.eod_id], dtype=np.int64)
        begins = np.array([piece.begin for piece in pieces], dtype=np.int64)
        ends = np.array([piece.end for piece in pieces], dtype=np.int64)
        for name, mask in scored_masks(doc["text"], doc["domain"], begins, ends, task.buckets, rare_keys).items():
            tokens_out[name].add(ids)
            masks_out[name].add(np.append(mask, 0))  # EOD is never scored
            stats[name]["documents"] += 1
            stats[name]["tokens"] += len(ids)
            stats[name]["scored_tokens"] += int(mask.sum())
        tally.add(docs=1, tokens=len(ids), units=1)
    for writer in (*tokens_out.values(), *masks_out.values()):
        writer.finish()
    tally.add(shards=1)
    tally.flush()
    return stats
