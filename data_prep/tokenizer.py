"""Merge step 2: train a sentencepiece BPE tokenizer on the train split, or adopt a given one.

The training sample is every deduplicated TRAIN document whose hash passes
`doc_hash.in_tokenizer_sample` at rate min(1, sample_bytes / train bytes): a deterministic
sample that the worker count and shard timing cannot change. Documents are fed one line per
sentence (sentencepiece's unit). The end-of-document token is sentencepiece's EOS piece.
"""

from __future__ import annotations

import io
import json
import logging
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from data_prep.atomic import sha256_file, write_bytes_atomic, write_json_atomic
from data_prep.config import PrepConfig, PrepError
from data_prep.dedup import TRAIN, Assignment, hash_rows
from data_prep.doc_hash import in_tokenizer_sample
from data_prep.inputs import Shard
from data_prep.parse_stage import iter_parsed_docs, load_index
from data_prep.pool import map_shards
from megatron_triroute.vocab import load_processor, tokenizer_path

log = logging.getLogger("data_prep")

TOO_HIGH = re.compile(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)")
TOO_LOW = re.compile(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)")


@dataclass
class TokenizerInfo:
    path: str
    """Relative to the output directory."""
    sha256: str
    vocab_size: int
    eod_id: int
    trained: bool
    requested_vocab_size: Optional[int]
    """What was asked for, when trained (differs from vocab_size after an adjustment)."""
    sample_documents: int
    sample_bytes: int


def prepare(config: PrepConfig, output: Path, work: Path, shards: list[Shard], assignment: Assignment,
            fingerprint: str) -> TokenizerInfo:
    """Produce `output/tokenizer/tokenizer.model`, reusing a previous run's when its record matches."""
    target = tokenizer_path(output)
    if config.tokenizer.model:
        source = Path(config.tokenizer.model)
        if not source.is_file():
            raise PrepError(f"--tokenizer {str(source)!r}: no such file. Fix: pass a sentencepiece .model path.")
        processor = load_processor(source, fix="pass a sentencepiece .model file, or --vocab-size N to train one")
        if target.resolve() != source.resolve():
            write_bytes_atomic(target, source.read_bytes())
        return _info(output, processor, trained=False, requested=None, sample=(0, 0))

    record_file = work / "tokenizer_record.json"
    params = {**asdict(config.tokenizer), "seed": config.seed, "inputs": fingerprint}
    params.pop("model")
    record = json.loads(record_file.read_text()) if record_file.exists() else None
    if record and record["params"] == params and target.exists() and sha256_file(target) == record["sha256"]:
        log.info("tokenizer: reusing %s (same sample and settings)", target)
        return TokenizerInfo(**record["info"])

    texts = _sample(config, work, shards, assignment)
    model, vocab = _train(texts, config)
    write_bytes_atomic(target, model)
    info = _info(output, load_processor(target), trained=True, requested=config.tokenizer.vocab_size,
                 sample=(len(texts), sum(len(t.encode("utf-8")) for t in texts)))
    write_json_atomic(record_file, {"params": params, "sha256": info.sha256, "info": asdict(info)})
    return info


def _info(output: Path, processor, trained: bool, requested: Optional[int], sample: tuple[int, int]) -> TokenizerInfo:
    eod = processor.eos_id()
    if eod < 0:
        raise PrepError("the tokenizer has no EOS piece (eos_id=-1), which is used as the end-of-document "
                        "token. Fix: retrain it with an EOS piece (sentencepiece's default eos_id=2).")
    target = tokenizer_path(output)
    return TokenizerInfo(path=str(target.relative_to(output)), sha256=sha256_file(target),
                         vocab_size=processor.vocab_size(), eod_id=eod, trained=trained,
                         requested_vocab_size=requested, sample_documents=sample[0], sample_bytes=sample[1])


def _sample(config: PrepConfig, work: Path, shards: list[Shard], assignment: Assignment) -> list[str]:
    train_bytes = 0
    for shard, codes in zip(shards, assignment.codes):
        train_bytes += int(load_index(work, shard)["nbytes"][codes == TRAIN].sum())
    if train_bytes == 0:
        raise PrepError("no training documents to train the tokenizer on (every document was rejected, a "
                        "duplicate, or in validation). Fix: check rejects.jsonl, lower --valid-fraction, or "
                        "pass --tokenizer MODEL.")
    rate = min(1.0, config.tokenizer.sample_bytes / train_bytes)
    jobs = [(str(work), shard, codes, rate, config.seed) for shard, codes in zip(shards, assignment.codes)]
    per_shard = map_shards(_sample_shard, jobs, config.shard.workers, describe=lambda job: job[1].path)
    return [text for texts in per_shard for text in texts]


def _sample_shard(job) -> list[str]:
    work, shard, codes, rate, seed = job
    rows = hash_rows(load_index(Path(work), shard)["hash"])
    texts = []
    for position, doc in enumerate(iter_parsed_docs(Path(work), shard)):
        if codes[position] == TRAIN and in_tokenizer_sample(rows[position].tobytes(), rate, seed):
            texts.append(doc["text"])
    return texts


def _sentences(texts: list[str]):
    for text in texts:
        for line in text.split("\n"):
            if line.strip():
                yield line


def _train(texts: list[str], config: PrepConfig) -> tuple[bytes, int]:
    import sentencepiece

    vocab = config.tokenizer.vocab_size
    for _attempt in range(2):
        model = io.BytesIO()
        try:
            sentencepiece.SentencePieceTrainer.train(
                sentence_iterator=_sentences(texts), model_writer=model, vocab_size=vocab, model_type="bpe",
                byte_fallback=True, character_coverage=config.tokenizer.character_coverage,
                # identity + kept whitespace: code indentation and exact text survive a round trip.
                normalization_rule_name="identity", remove_extra_whitespaces=False,
                allow_whitespace_only_pieces=True, split_digits=True, max_sentence_length=16384,
                num_threads=config.tokenizer.threads, minloglevel=2,
            )
            return model.getvalue(), vocab
        except RuntimeError as err:
            too_high, too_low = TOO_HIGH.search(str(err)), TOO_LOW.search(str(err))
            if too_high:
                new_vocab = int(too_high.group(2))
                log.warning("tokenizer: vocabulary size %d is too large for this corpus' sample; sentencepiece "
                            "allows at most %d, so training with %d (recorded in summary.json). Pass "
                            "--vocab-size %d or less to silence this.", vocab, new_vocab, new_vocab, new_vocab)
                vocab = new_vocab
                continue
            if too_low:
                raise PrepError(f"--vocab-size {vocab}: below the {too_low.group(2)} pieces this sample needs "
                                f"(256 byte pieces, <unk>/<s>/</s> and one per character kept at character "
                                f"coverage {config.tokenizer.character_coverage}). Fix: pass --vocab-size "
                                f"{too_low.group(2)} or more.") from err
            raise
    raise AssertionError("unreachable: the second attempt uses sentencepiece's own maximum")

