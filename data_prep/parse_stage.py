"""Stage 1, per shard: read, validate, hash. The work a Slurm array task does.

For each shard it writes `work/parsed/<shard_id>/`:
  docs.jsonl.zst  accepted documents in input order: {"n": record number, "domain", "text"}
  index.npy       one row per accepted document: dedup hash, record number, UTF-8 bytes
  rejects.jsonl   one line per rejected record (reason, line, raw bytes in base64)
  stats.json      read / accepted / rejected-by-reason counts and the input checksum
Outputs go to a temporary directory renamed into place when complete; then the manifest record
is written. Nothing here depends on other shards, so tasks can run in any order, anywhere.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zstandard

from data_prep.crash_hook import crash_limit, crash_now
from data_prep.doc_hash import HASH_BYTES, document_hash
from data_prep.inputs import Shard
from data_prep.manifest import load_record, outputs_intact, rebuild_stage_output
from data_prep.pool import worker_counters
from data_prep.progress import Tally
from data_prep.readers import ShardReader, input_sha256
from data_prep.records import Document

STAGE = "parse"
DOC_INDEX_DTYPE = np.dtype([("hash", f"S{HASH_BYTES}"), ("number", "<i8"), ("nbytes", "<i8")])


@dataclass(frozen=True)
class ParseTask:
    shard: Shard
    work: str
    text_field: str


def parsed_dir(work: Path, shard: Shard) -> Path:
    return work / "parsed" / shard.shard_id


def load_stats(work: Path, shard: Shard) -> dict:
    return json.loads((parsed_dir(work, shard) / "stats.json").read_text("utf-8"))


def load_index(work: Path, shard: Shard) -> np.ndarray:
    return np.load(parsed_dir(work, shard) / "index.npy")


def iter_parsed_docs(work: Path, shard: Shard):
    """Accepted documents of a parsed shard, in input order, as dicts {"n", "domain", "text"}."""
    with open(parsed_dir(work, shard) / "docs.jsonl.zst", "rb") as raw:
        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        for line in io.TextIOWrapper(reader, encoding="utf-8"):
            yield json.loads(line)


def is_finished(task: ParseTask) -> bool:
    """True when the manifest says this shard is done and every checksum still matches."""
    work, shard = Path(task.work), task.shard
    record = load_record(work, STAGE, shard.shard_id)
    if record is None or record.get("params") != {"text_field": task.text_field}:
        return False
    if record.get("shard") != shard.path or record.get("format") != shard.format:
        return False
    if input_sha256(shard) != record.get("input_sha256"):
        return False
    return outputs_intact(parsed_dir(work, shard), record.get("outputs", {}))


def run(task: ParseTask) -> dict:
    """Parse one shard unless already finished; returns its stats (plus "skipped")."""
    work, shard = Path(task.work), task.shard
    tally = Tally(worker_counters())
    if is_finished(task):
        stats = load_stats(work, shard)
        tally.add(docs=stats["read"], units=stats["input_bytes"], shards=1)
        tally.flush()
        return {**stats, "skipped": True}
    stats = rebuild_stage_output(
        work, STAGE, shard.shard_id, parsed_dir(work, shard), lambda tmp: _parse_into(task, tmp, tally),
        lambda stats: {"stage": STAGE, "shard": shard.path, "format": shard.format,
                       "input_sha256": stats["input_sha256"], "params": {"text_field": task.text_field}},
    )
    tally.add(shards=1)
    tally.flush()
    return {**stats, "skipped": False}


def _parse_into(task: ParseTask, out: Path, tally: Tally) -> dict:
    shard = task.shard
    reader = ShardReader(shard, task.text_field, on_bytes=lambda n: tally.add(units=n))
    limit = crash_limit(STAGE, shard.path)
    rejected: Counter[str] = Counter()
    index_rows = []
    read = text_bytes = 0
    with open(out / "docs.jsonl.zst", "wb") as docs_raw, open(out / "rejects.jsonl", "w", encoding="utf-8") as rej:
        docs = zstandard.ZstdCompressor(level=3).stream_writer(docs_raw)
        for outcome in reader:
            read += 1
            if isinstance(outcome, Document):
                encoded = outcome.text.encode("utf-8")
                index_rows.append((document_hash(outcome.text), outcome.number, len(encoded)))
                text_bytes += len(encoded)
                line = {"n": outcome.number, "domain": outcome.domain, "text": outcome.text}
                docs.write(json.dumps(line, ensure_ascii=False).encode("utf-8") + b"\n")
            else:
                rejected[outcome.reason] += 1
                rej.write(json.dumps(outcome.to_json(shard.path), sort_keys=True) + "\n")
            tally.add(docs=1)
            if limit is not None and read >= limit:
                crash_now()
        docs.flush(zstandard.FLUSH_FRAME)
    np.save(out / "index.npy", np.array(index_rows, dtype=DOC_INDEX_DTYPE))
    accepted = len(index_rows)
    if read != accepted + sum(rejected.values()):
        raise AssertionError(f"{shard.path}: read {read} != accepted {accepted} + rejected {sum(rejected.values())}")
    stats = {
        "shard": shard.path, "format": shard.format, "input_sha256": reader.sha256,
        "input_bytes": reader.bytes_read, "read": read, "accepted": accepted,
        "rejected": dict(sorted(rejected.items())), "text_bytes": text_bytes,
    }
    (out / "stats.json").write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return stats
