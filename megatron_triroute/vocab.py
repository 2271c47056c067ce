"""The run's vocabulary on disk: the sentencepiece tokenizer and its per-token tables.

`python -m data_prep` writes both under the data directory; training, evaluation, generation and
export read them from there (one place, so data_prep and the package share it without importing
each other both ways: data_prep imports this package, never the reverse).

    DATA/tokenizer/tokenizer.model            the sentencepiece model (EOD = its EOS piece)
    DATA/tokenizer/token_tables.safetensors   the tables the router's side features need:
      log_prob    float32[V]  natural-log unigram probability of every token id, counted over the
                              TRAIN split only (EOD tokens included), add-one smoothed:
                              log((count[i] + 1) / (total + V)), so every id is finite.
      word_start  uint8[V]    1 if the token starts a word (rule: `word_start_table`).
    and metadata (strings, as safetensors requires): eod_id, vocab_size, tokenizer_sha256.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .input_errors import InputError

TOKENIZER_FILE = "tokenizer/tokenizer.model"
"""The sentencepiece model, relative to the data directory."""
TABLES_FILE = "tokenizer/token_tables.safetensors"
"""The per-token tables, relative to the data directory."""


class VocabError(InputError, ValueError):
    """The tokenizer or its tables cannot be read; the message names the file and the fix."""


def tokenizer_path(data: Path) -> Path:
    return Path(data) / TOKENIZER_FILE


def tables_path(data: Path) -> Path:
    return Path(data) / TABLES_FILE


def load_processor(path: Path, fix: str = "regenerate it with `python -m data_prep build`"):
    """The sentencepiece processor of the model file `path`."""
    import sentencepiece

    try:
        return sentencepiece.SentencePieceProcessor(model_file=str(path))
    except (OSError, RuntimeError) as err:
        raise VocabError(f"tokenizer {str(path)!r} cannot be loaded ({err}). Fix: {fix}.") from err


def run_vocab_files(data: Path, fix: str) -> tuple[Path, Path]:
    """(tokenizer model, token tables) of the data directory `data` a run recorded (or was given);
    refused, naming both and `fix`, when either is not there."""
    model_file, tables = tokenizer_path(data), tables_path(data)
    if not model_file.is_file() or not tables.is_file():
        raise VocabError(f"the run's tokenizer is not at {model_file} (with {tables.name}): the data directory "
                         f"{str(data)!r} (the run's recorded data.path unless given) is not reachable here. Fix: "
                         f"{fix}.")
    return model_file, tables


def decode_generated(processor, ids: list[int], eod: int) -> str:
    """Text of generated token ids, without EOD and without the ids the model's padded vocabulary
    adds past the tokenizer's pieces (they have no text)."""
    pieces = processor.get_piece_size()
    return processor.decode([t for t in ids if t < pieces and t != eod])


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

    from .durability import write_bytes_atomic

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

    Raises `VocabError` naming the file when it lacks a table or the metadata disagree with the shapes.
    """
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
        names = set(handle.keys())
        missing = {"log_prob", "word_start"} - names
        if missing or "eod_id" not in metadata or "vocab_size" not in metadata:
            raise VocabError(f"{path}: not a token-tables file (missing {sorted(missing) or 'metadata'}). "
                             "Fix: regenerate it with `python -m data_prep build`.")
        log_prob = handle.get_tensor("log_prob")
        word_start = handle.get_tensor("word_start").bool()
    vocab_size, eod_id = int(metadata["vocab_size"]), int(metadata["eod_id"])
    if log_prob.shape != (vocab_size,) or word_start.shape != (vocab_size,) or not 0 <= eod_id < vocab_size:
        raise VocabError(f"{path}: tables of shape {tuple(log_prob.shape)}/{tuple(word_start.shape)} with "
                         f"eod_id={eod_id} disagree with vocab_size={vocab_size}. Fix: regenerate the file.")
    return log_prob, word_start, eod_id
