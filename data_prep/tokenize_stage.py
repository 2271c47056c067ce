"""Merge step 3, per shard: tokenize the kept documents into per-shard indexed datasets.

Writes `work/tokenized/<shard_id>/`:
  train.bin/.idx, valid.bin/.idx   this shard's documents, each followed by the EOD token
  train_counts.npy                 int64[V] token counts over this shard's train documents
  train_entities.npz               entity keys and their counts in train documents (non-code)
  valid_entities.npy               entity keys occurring in validation documents (non-code)
  valid_docs.jsonl.zst             the validation documents' text, for the bucket step
  stats.json                       documents and tokens per split
Like the parse stage: temporary directory, atomic rename, then a manifest record whose inputs
(parsed docs, assignment, tokenizer, code rule) must all match for a resume to skip it.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zstandard

from data_prep.atomic import sha256_file
from data_prep.buckets import entity_keys, is_code_document
from data_prep.config import BucketConfig
from data_prep.crash_hook import crash_limit, crash_now
from data_prep.dedup import TRAIN, VALID, assign_path
from data_prep.inputs import Shard
from data_prep.manifest import load_record, outputs_intact, rebuild_stage_output
from data_prep.megatron_io import DatasetWriter
from data_prep.parse_stage import iter_parsed_docs, parsed_dir
from data_prep.pool import worker_counters
from data_prep.progress import Tally

STAGE = "tokenize"
ENCODE_BATCH = 256


@dataclass(frozen=True)
class TokenizeTask:
    shard: Shard
    work: str
    tokenizer: str
    tokenizer_sha256: str
    eod_id: int
    dtype: str
    buckets: BucketConfig


def tokenized_dir(work: Path, shard: Shard) -> Path:
    return work / "tokenized" / shard.shard_id


def _inputs(task: TokenizeTask) -> dict:
    work = Path(task.work)
    return {
        "parsed_docs_sha256": sha256_file(parsed_dir(work, task.shard) / "docs.jsonl.zst"),
        "assign_sha256": sha256_file(assign_path(work, task.shard)),
        "tokenizer_sha256": task.tokenizer_sha256,
        "dtype": task.dtype,
        # Only the code rule shapes these outputs (code documents are left out of entity counts);
        # other bucket thresholds can change without re-tokenizing.
        "code_rule": [task.buckets.code_min_lines, task.buckets.code_min_line_fraction],
    }


def run(task: TokenizeTask) -> dict:
    work, shard = Path(task.work), task.shard
    tally = Tally(worker_counters())
    inputs = _inputs(task)
    record = load_record(work, STAGE, shard.shard_id)
    if record and record.get("inputs") == inputs and outputs_intact(tokenized_dir(work, shard), record["outputs"]):
        stats = json.loads((tokenized_dir(work, shard) / "stats.json").read_text("utf-8"))
        tally.add(docs=stats["train_docs"] + stats["valid_docs"], tokens=stats["train_tokens"] + stats["valid_tokens"],
                  units=stats["train_docs"] + stats["valid_docs"], shards=1)
        tally.flush()
        return {**stats, "skipped": True}
    stats = rebuild_stage_output(
        work, STAGE, shard.shard_id, tokenized_dir(work, shard), lambda tmp: _tokenize_into(task, tmp, tally),
        lambda stats: {"stage": STAGE, "shard": shard.path, "inputs": inputs},
    )
    tally.add(shards=1)
    tally.flush()
    return {**stats, "skipped": False}


def _tokenize_into(task: TokenizeTask, out: Path, tally: Tally) -> dict:
    import sentencepiece

    work, shard = Path(task.work), task.shard
    processor = sentencepiece.SentencePieceProcessor(model_file=task.tokenizer)
    codes = np.load(assign_path(work, shard))
    dtype = getattr(np, task.dtype)
    writers = {TRAIN: DatasetWriter(out / "train", dtype), VALID: DatasetWriter(out / "valid", dtype)}
    counts = np.zeros(processor.vocab_size(), dtype=np.int64)
    train_entities: Counter[int] = Counter()
    valid_entities: set[int] = set()
    limit = crash_limit(STAGE, shard.path)
    done = 0
    with open(out / "valid_docs.jsonl.zst", "wb") as valid_raw:
        valid_docs = zstandard.ZstdCompressor(level=3).stream_writer(valid_raw)
        for batch in _kept_batches(iter_parsed_docs(work, shard), codes):
            encoded = processor.encode([doc["text"] for _, doc in batch], num_threads=1)
            train_tokens = []
            for (code, doc), ids in zip(batch, encoded):
                tokens = np.asarray(ids + [task.eod_id], dtype=np.int64)
                writers[code].add(tokens)
                code_doc = is_code_document(doc["text"], doc["domain"], task.buckets)
                if code == TRAIN:
                    train_tokens.append(tokens)
                    if not code_doc:
                        train_entities.update(entity_keys(doc["text"]))
                else:
                    valid_docs.write(json.dumps(doc, ensure_ascii=False).encode("utf-8") + b"\n")
                    if not code_doc:
                        valid_entities.update(entity_keys(doc["text"]))
                tally.add(docs=1, tokens=len(tokens), units=1)
                done += 1
                if limit is not None and done >= limit:
                    crash_now()
            if train_tokens:  # one bincount per batch: a V-sized array per document would dominate
                counts += np.bincount(np.concatenate(train_tokens), minlength=len(counts))
        valid_docs.flush(zstandard.FLUSH_FRAME)
    for writer in writers.values():
        writer.finish()
    keys = np.array(sorted(train_entities), dtype=np.uint64)
    np.savez(out / "train_entities.npz", keys=keys, counts=np.array([train_entities[k] for k in keys.tolist()], np.int64))
    np.save(out / "valid_entities.npy", np.array(sorted(valid_entities), dtype=np.uint64))
    np.save(out / "train_counts.npy", counts)
    stats = {"train_docs": writers[TRAIN].documents, "valid_docs": writers[VALID].documents,
             "train_tokens": writers[TRAIN].tokens, "valid_tokens": writers[VALID].tokens}
    (out / "stats.json").write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return stats


def _kept_batches(docs, codes: np.ndarray):
    """(code, doc) of kept documents in input order, in batches; checks the assignment fits."""
    batch = []
    position = -1
    for position, doc in enumerate(docs):
        if position >= len(codes):
            break
        if codes[position] in (TRAIN, VALID):
            batch.append((int(codes[position]), doc))
            if len(batch) == ENCODE_BATCH:
                yield batch
                batch = []
    if position + 1 != len(codes):
        raise AssertionError(f"assignment has {len(codes)} codes but the parsed shard has a different number of "
                             "documents; delete the work/ directory and rerun")
    if batch:
        yield batch
