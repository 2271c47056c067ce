"""Per-token tables the router's side features need, saved beside the tokenizer.

`tokenizer/token_tables.safetensors` holds
  log_prob    float32[V]  natural-log unigram probability of every token id, counted over the
                          TRAIN split only (EOD tokens included), add-one smoothed:
                          log((count[i] + 1) / (total + V)), so every id is finite.
  word_start  uint8[V]    1 if the token starts a word (rule: `word_start_table`).
and metadata (strings, as safetensors requires): eod_id, vocab_size, tokenizer_sha256.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

WHITESPACE_BYTES = (0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20)
"""Tab, newline, vertical tab, form feed, carriage return, space."""


def log_prob_table(train_counts: np.ndarray) -> np.ndarray:
    """log((c_i + 1) / (sum_j c_j + V)) for every id i (add-one / Laplace smoothing)."""
    counts = train_counts.astype(np.float64)
    return np.log((counts + 1.0) / (counts.sum() + len(counts))).astype(np.float32)


def word_start_table(processor) -> np.ndarray:
    """1 where a token begins a word, else 0. The exact rule, per id:

    - a normal piece whose text begins with "▁" (U+2581, sentencepiece's marker for a preceding
      space, also put at the start of every document) -> 1; this includes whitespace-only
      pieces such as "▁▁";
    - a byte-fallback piece <0xXX> whose byte is whitespace (tab, LF, VT, FF, CR, space) -> 1
      (sentencepiece emits newlines and tabs as such byte pieces);
    - a control piece (<s>, </s> = EOD) or the unknown piece <unk> -> 1 (they separate text);
    - everything else (word-internal pieces, other byte pieces, punctuation glued to the
      preceding text) -> 0.
    """
    table = np.zeros(processor.vocab_size(), dtype=np.uint8)
    for token_id in range(processor.vocab_size()):
        piece = processor.id_to_piece(token_id)
        if processor.is_control(token_id) or processor.is_unknown(token_id):
            table[token_id] = 1
        elif processor.is_byte(token_id):
            table[token_id] = int(int(piece[3:5], 16) in WHITESPACE_BYTES)  # piece is "<0xXX>"
        else:
            table[token_id] = int(piece.startswith("\u2581"))
    return table


def save_token_tables(path: Path, processor, train_counts: np.ndarray, eod_id: int, tokenizer_sha256: str) -> None:
    from safetensors.numpy import save

    from data_prep.atomic import write_bytes_atomic

    if len(train_counts) != processor.vocab_size():
        raise AssertionError(f"{len(train_counts)} counts for a vocabulary of {processor.vocab_size()}")
    tensors = {"log_prob": log_prob_table(train_counts), "word_start": word_start_table(processor)}
    metadata = {"eod_id": str(eod_id), "vocab_size": str(processor.vocab_size()), "tokenizer_sha256": tokenizer_sha256}
    write_bytes_atomic(path, _sorted_header(save(tensors, metadata=metadata)))


def _sorted_header(blob: bytes) -> bytes:
    """Rewrite the safetensors JSON header with sorted keys, same length.

    The library orders header keys by a per-process hash map, so identical tables would give
    different bytes from run to run; sorting makes reruns byte-identical. Data offsets are
    values in the header, so reordering keys moves no tensor bytes.
    """
    import json

    size = int.from_bytes(blob[:8], "little")
    header = json.dumps(json.loads(blob[8:8 + size]), sort_keys=True, separators=(",", ":")).encode("utf-8")
    if len(header) > size:
        raise AssertionError("re-serialised safetensors header grew")
    return blob[:8] + header + b" " * (size - len(header)) + blob[8 + size:]


def load_token_tables(path):
    """Load `token_tables.safetensors` -> (log_prob float32 tensor [V], word_start bool tensor [V], eod_id).

    Raises ValueError naming the file when it lacks a table or the metadata disagree with the shapes.
    """
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
        names = set(handle.keys())
        missing = {"log_prob", "word_start"} - names
        if missing or "eod_id" not in metadata or "vocab_size" not in metadata:
            raise ValueError(f"{path}: not a token-tables file (missing {sorted(missing) or 'metadata'}). "
                             "Fix: regenerate it with `python -m data_prep build`.")
        log_prob = handle.get_tensor("log_prob")
        word_start = handle.get_tensor("word_start").bool()
    vocab_size, eod_id = int(metadata["vocab_size"]), int(metadata["eod_id"])
    if log_prob.shape != (vocab_size,) or word_start.shape != (vocab_size,) or not 0 <= eod_id < vocab_size:
        raise ValueError(f"{path}: tables of shape {tuple(log_prob.shape)}/{tuple(word_start.shape)} with "
                         f"eod_id={eod_id} disagree with vocab_size={vocab_size}. Fix: regenerate the file.")
    return log_prob, word_start, eod_id
