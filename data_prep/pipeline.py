"""The pipeline's stages in order: `shard` (per-shard parse) and `merge` (everything global).

  shard:  parse_stage       read, validate, hash each shard            (parallel, resumable)
  merge:  dedup             first occurrence in canonical order wins; hash-based split
          tokenizer         train on a hash-sampled train split, or adopt --tokenizer
          tokenize_stage    per-shard train/valid datasets + counts   (parallel, resumable)
          tables            log_prob / word_start beside the tokenizer
          bucket_stage      tail buckets from validation documents    (parallel)
          final outputs     concatenate per-shard datasets in canonical order, rejects, summary
`build` = shard over all inputs, then merge. `summary.json` is removed when a merge starts and
written last, so its presence means every output of that merge is complete.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from collections import Counter
from pathlib import Path

import numpy as np

from data_prep import bucket_stage, dedup, parse_stage, tokenize_stage
from data_prep import tokenizer as tokenizer_step
from data_prep.atomic import TMP_MARK, publish_file, sha256_file, write_json_atomic, write_npy_atomic
from data_prep.buckets import BUCKETS
from data_prep.config import PrepConfig, PrepError, ShardConfig
from data_prep.inputs import Shard, expand_inputs, task_range
from data_prep.manifest import load_record, outputs_intact, write_consolidated
from data_prep.pool import map_shards
from data_prep.progress import Counters, ProgressLine
from megatron_triroute.vocab import TABLES_FILE, load_processor, save_token_tables

log = logging.getLogger("data_prep")

TRAIN_PREFIX = "train_text_document"
VALID_PREFIX = "valid_text_document"
BUCKET_DIR = "buckets"


def _work(output: Path) -> Path:
    return output / "work"


def _run_stage(name: str, fn, tasks: list, workers: int, total_units: int) -> list:
    counters = Counters()
    progress = ProgressLine(name, counters, total_units=total_units, total_shards=len(tasks))
    try:
        return map_shards(fn, tasks, workers, counters, describe=lambda task: task.shard.path,
                          on_started=progress.start)
    finally:
        progress.close()


# -- shard ------------------------------------------------------------------------------------------

def run_shard_stage(config: ShardConfig, task_index: int = 0, num_tasks: int = 1) -> list[dict]:
    """Parse this task's contiguous range of the sorted shards (all of them for 0 of 1)."""
    config.validate()
    shards = expand_inputs(config.inputs)
    mine = [shards[i] for i in task_range(len(shards), task_index, num_tasks)]
    if not mine:
        log.info("task %d of %d: no shards in range (there are %d shards)", task_index, num_tasks, len(shards))
        return []
    work = _work(Path(config.output))
    tasks = [parse_stage.ParseTask(shard, str(work), config.text_field) for shard in mine]
    total_bytes = sum(_input_size(shard) for shard in mine)
    stats = _run_stage("parse", parse_stage.run, tasks, config.workers, total_bytes)
    skipped = sum(1 for s in stats if s["skipped"])
    log.info("parse: %d shards done (%d already finished and verified, skipped)", len(stats), skipped)
    return stats


def _input_size(shard: Shard) -> int:
    path = Path(shard.path)
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*.txt"))
    return path.stat().st_size


# -- merge ------------------------------------------------------------------------------------------

def run_merge(config: PrepConfig) -> dict:
    config.validate()
    output = Path(config.shard.output)
    work = _work(output)
    shards = expand_inputs(config.shard.inputs)
    _require_parsed(work, shards, config.shard.text_field)
    (output / "summary.json").unlink(missing_ok=True)
    parse_stats = [parse_stage.load_stats(work, shard) for shard in shards]
    _write_rejects(output, work, shards)

    assignment = dedup.assign_documents(work, shards, config.valid_fraction, config.seed)
    if assignment.count(dedup.TRAIN) == 0:
        read, rejected = sum(s["read"] for s in parse_stats), sum(sum(s["rejected"].values()) for s in parse_stats)
        raise PrepError(f"nothing valid remains for training: of {read} records read, {rejected} were rejected "
                        f"(see {output / 'rejects.jsonl'}), {assignment.count(dedup.DUPLICATE)} were duplicates and "
                        f"{assignment.count(dedup.VALID)} went to validation. Fix: check the inputs and --text-field, "
                        "or lower --valid-fraction.")
    info = tokenizer_step.prepare(config, output, work, shards, assignment, _fingerprint(work, shards))
    log.info("tokenizer: %s (vocab %d, eod id %d, %s)", output / info.path, info.vocab_size, info.eod_id,
             "trained" if info.trained else "given")
    from data_prep.megatron_io import token_dtype

    dtype = np.dtype(token_dtype(info.vocab_size)).name
    model = str(output / info.path)

    tok_tasks = [tokenize_stage.TokenizeTask(shard, str(work), model, info.sha256, info.eod_id, dtype, config.buckets)
                 for shard in shards]
    tok_stats = _run_stage("tokenize", tokenize_stage.run, tok_tasks, config.shard.workers,
                           assignment.count(dedup.TRAIN) + assignment.count(dedup.VALID))

    counts = sum((np.load(tokenize_stage.tokenized_dir(work, s) / "train_counts.npy") for s in shards),
                 np.zeros(info.vocab_size, dtype=np.int64))
    save_token_tables(output / TABLES_FILE, load_processor(Path(model)), counts, info.eod_id, info.sha256)

    rare_file = work / "rare_entity_keys.npy"
    write_npy_atomic(rare_file, _rare_entity_keys(work, shards, config.buckets.rare_entity_max_train_count))
    bucket_tasks = [bucket_stage.BucketTask(shard, str(work), model, info.eod_id, dtype, config.buckets, str(rare_file))
                    for shard in shards]
    bucket_stats = _run_stage("buckets", bucket_stage.run, bucket_tasks, config.shard.workers,
                              assignment.count(dedup.VALID))

    datasets = _write_datasets(output, work, shards, dtype, tok_stats, bucket_stats)
    summary = _summary(config, shards, parse_stats, assignment, info, dtype, tok_stats, bucket_stats, datasets)
    write_consolidated(output, work, [s.shard_id for s in shards])
    write_json_atomic(output / "summary.json", summary)
    _report(summary, output)
    return summary


def run_build(config: PrepConfig) -> dict:
    run_shard_stage(config.shard)
    return run_merge(config)


def _require_parsed(work: Path, shards: list[Shard], text_field: str) -> None:
    # The input checksums were verified when the shard stage ran; here we check the records and
    # that the parsed outputs are intact (re-reading every input would double the I/O of a merge).
    missing = []
    for index, shard in enumerate(shards):
        record = load_record(work, parse_stage.STAGE, shard.shard_id)
        if (record is None or record.get("params") != {"text_field": text_field}
                or not outputs_intact(parse_stage.parsed_dir(work, shard), record["outputs"])):
            missing.append(f"#{index} {shard.path}")
    if missing:
        listed = "; ".join(missing[:10]) + (f"; ... ({len(missing)} in all)" if len(missing) > 10 else "")
        raise PrepError(f"{len(missing)} of {len(shards)} shards have no finished parse: {listed}. Fix: run "
                        "`python -m data_prep shard` with the same --input/--output/--text-field for the "
                        "tasks covering them (or `build`), then merge again.")


def _fingerprint(work: Path, shards: list[Shard]) -> str:
    """Identifies the deduplicated, split corpus (what the tokenizer sample is drawn from)."""
    digest = hashlib.sha256()
    for shard in shards:
        digest.update(sha256_file(parse_stage.parsed_dir(work, shard) / "index.npy").encode())
        digest.update(sha256_file(dedup.assign_path(work, shard)).encode())
    return digest.hexdigest()


def _rare_entity_keys(work: Path, shards: list[Shard], max_count: int) -> np.ndarray:
    """Entity keys seen in validation whose train count is <= max_count. Only validation keys are
    tracked, so memory scales with the validation set, not with the train vocabulary of names."""
    valid_keys = np.unique(np.concatenate(
        [np.load(tokenize_stage.tokenized_dir(work, s) / "valid_entities.npy") for s in shards] + [np.array([], np.uint64)]))
    train_counts = np.zeros(len(valid_keys), dtype=np.int64)
    for shard in shards:
        with np.load(tokenize_stage.tokenized_dir(work, shard) / "train_entities.npz") as data:
            keys, counts = data["keys"], data["counts"]
        position = np.searchsorted(valid_keys, keys)
        hit = position < len(valid_keys)
        hit[hit] = valid_keys[position[hit]] == keys[hit]
        np.add.at(train_counts, position[hit], counts[hit])
    return valid_keys[train_counts <= max_count]


def _concat(output: Path, prefix: str, parts: list[Path], dtype) -> None:
    from data_prep.megatron_io import DatasetWriter, remove_dataset

    target = output / prefix
    target.parent.mkdir(parents=True, exist_ok=True)
    if not parts:
        remove_dataset(target)  # Megatron cannot memory-map an empty .bin, so no dataset is written
        return
    writer = DatasetWriter(target, dtype, temporary=True)
    for part in parts:
        writer.append_dataset(part)
    writer.finish()


def _write_datasets(output: Path, work: Path, shards: list[Shard], dtype: str, tok_stats, bucket_stats) -> dict:
    token_type = getattr(np, dtype)
    datasets: dict = {}
    for split, prefix in (("train", TRAIN_PREFIX), ("valid", VALID_PREFIX)):
        parts = [tokenize_stage.tokenized_dir(work, s) / split for s, st in zip(shards, tok_stats) if st[f"{split}_docs"]]
        _concat(output, prefix, parts, token_type)
        datasets[split] = prefix if parts else None
        if not parts:
            log.warning("the %s split is empty, so %s.bin/.idx is not written", split, prefix)
    datasets["buckets"] = {}
    for name in BUCKETS:
        with_docs = [bucket_stage.bucket_dir(work, s) for s, st in zip(shards, bucket_stats) if st[name]["documents"]]
        for kind, dt in (("text_document", token_type), ("loss_mask", np.uint8)):
            _concat(output, f"{BUCKET_DIR}/{name}_{kind}", [d / f"{name}_{kind}" for d in with_docs], dt)
        datasets["buckets"][name] = ({"tokens": f"{BUCKET_DIR}/{name}_text_document",
                                      "loss_mask": f"{BUCKET_DIR}/{name}_loss_mask"} if with_docs else None)
        if not with_docs:
            log.warning("bucket %s is empty (no validation document matched), so it is not written", name)
    return datasets


def _write_rejects(output: Path, work: Path, shards: list[Shard]) -> None:
    target = output / "rejects.jsonl"
    tmp = target.with_name(target.name + TMP_MARK + "merge")
    with open(tmp, "wb") as out:
        for shard in shards:
            with open(parse_stage.parsed_dir(work, shard) / "rejects.jsonl", "rb") as part:
                shutil.copyfileobj(part, out)
    publish_file(tmp, target)


def _summary(config, shards, parse_stats, assignment, info, dtype, tok_stats, bucket_stats, datasets) -> dict:
    rejected: Counter[str] = Counter()
    inputs = []
    for shard, stats, codes in zip(shards, parse_stats, assignment.codes):
        rejected.update(stats["rejected"])
        inputs.append({"path": shard.path, "format": shard.format, "sha256": stats["input_sha256"],
                       "bytes": stats["input_bytes"], "read": stats["read"], "accepted": stats["accepted"],
                       "duplicates": int((codes == dedup.DUPLICATE).sum()), "rejected": stats["rejected"]})
    read = sum(s["read"] for s in parse_stats)
    train, valid = sum(s["train_docs"] for s in tok_stats), sum(s["valid_docs"] for s in tok_stats)
    duplicates = assignment.count(dedup.DUPLICATE)
    total_rejected = sum(rejected.values())
    # The invariant the whole design is for: every record read is written, a duplicate, or rejected.
    if read != train + valid + duplicates + total_rejected:
        raise AssertionError(f"accounting broken: read {read} != train {train} + valid {valid} + duplicates "
                             f"{duplicates} + rejected {total_rejected}")
    buckets = {name: {key: sum(s[name][key] for s in bucket_stats) for key in ("documents", "tokens", "scored_tokens")}
               for name in BUCKETS}
    cfg = config.to_dict()
    cfg["shard"] = {k: v for k, v in cfg["shard"].items() if k not in ("workers", "output")}  # do not change outputs
    return {
        "documents": {"read": read, "written": {"train": train, "valid": valid, "total": train + valid},
                      "duplicates": duplicates, "rejected": {"total": total_rejected, "by_reason": dict(sorted(rejected.items()))}},
        "tokens": {"train": sum(s["train_tokens"] for s in tok_stats), "valid": sum(s["valid_tokens"] for s in tok_stats),
                   "buckets": buckets},
        "datasets": datasets,
        "token_dtype": dtype,
        "tokenizer": {**info.__dict__, "tables": TABLES_FILE},
        "inputs": inputs,
        "rejects_file": "rejects.jsonl",
        "config": cfg,
    }


def _report(summary: dict, output: Path) -> None:
    docs = summary["documents"]
    log.info("accounting: read %d = written %d (train %d + valid %d) + duplicates %d + rejected %d",
             docs["read"], docs["written"]["total"], docs["written"]["train"], docs["written"]["valid"],
             docs["duplicates"], docs["rejected"]["total"])
    if docs["rejected"]["by_reason"]:
        log.info("rejected by reason: %s (details in %s)", ", ".join(
            f"{reason} {count}" for reason, count in docs["rejected"]["by_reason"].items()), output / "rejects.jsonl")
    tokens = summary["tokens"]
    log.info("tokens: train %d, valid %d; buckets: %s", tokens["train"], tokens["valid"], ", ".join(
        f"{name} {b['documents']} docs / {b['scored_tokens']} scored" for name, b in tokens["buckets"].items()))
    log.info("wrote %s (see summary.json)", output)
