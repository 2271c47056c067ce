"""The tail-bucket rules: which parts of a validation document each bucket scores.

Pure functions of text (and token offsets); `bucket_stage.py` applies them. Every bucket
document is a whole validation document (its tokens and EOD exactly as in the validation set),
so each scored span keeps all of its preceding document context; a parallel 0/1 loss mask says
which tokens are scored. mask[i] = 1 means token i is a scored target (predicted from tokens
< i). EOD is never scored.

Rules (thresholds in `config.BucketConfig`):
- rare_entity: in non-code documents, each sentence holding a rare entity. Sentences are split
  after . ! ? (optionally followed by a closing quote or bracket) plus whitespace, and at every
  newline. An entity is a run of capitalised words (a word = an uppercase Latin letter followed
  by one or more word characters, e.g. "Zanzibar", "McKay", "NASA"), words separated by spaces or
  tabs; a run's first word is dropped when it opens its sentence (every sentence starts with a
  capital). An entity is rare when it occurs at most `rare_entity_max_train_count` times, as an
  entity, in the deduplicated train split.
- code: the whole document, when its domain label is "Github" (any case), or when it has at least
  `code_min_lines` non-blank lines of which at least `code_min_line_fraction` look like code
  (`CODE_LINE`).
- math: in non-code documents, each line with at least `math_min_operators` arithmetic operators
  between numbers (`ARITH_OPERATOR`), at least one of them not a minus sign (so dates like
  2024-01-15 and ranges are not math), and digits plus arithmetic symbols making up at least
  `math_min_symbol_fraction` of its non-space characters.
- long_context: documents with more than `long_context_min_tokens` tokens (EOD excluded); the
  scored tokens are those at positions >= `long_context_min_tokens`.
"""

from __future__ import annotations

import hashlib
import re

import numpy as np

from data_prep.config import BucketConfig

BUCKETS = ("rare_entity", "code", "math", "long_context")
CODE_DOMAINS = ("github",)

_SENTENCE_BREAK = re.compile(r"(?<=[.!?])[ \t]+|(?<=[.!?][\"')\]])[ \t]+|\n")
_CAPITAL_WORD = r"[A-ZÀ-ÖØ-Þ]\w+"
_ENTITY_RUN = re.compile(rf"(?<!\w){_CAPITAL_WORD}(?:[ \t]+{_CAPITAL_WORD})*")
_FIRST_WORD_CHAR = re.compile(r"\w")

CODE_LINE = re.compile(
    r"^\s*(?:def |class |import |from \S+ import |return\b|elif |else:|try:|except\b|finally:|with .*:$"
    r"|if .*:$|for .*:$|while .*:$|#include|#define|public |private |protected |static |function\b"
    r"|var |let |const |package |func |fn |use |@\w+|//|/\*|\*/|[{}])"
    r"|[;{}]\s*$|\)\s*:\s*$|==|!=|=>|->|::|&&|\|\|"
)
"""A line "looks like code": it starts with a keyword common to Python/C/Java/JS/Go/Rust (or a
brace, decorator, comment opener), ends with ; { } or ):, or contains == != => -> :: && ||."""

ARITH_OPERATOR = re.compile(r"[\d)]\s*([-+*/×÷^=])(?=\s*\(*\s*-?\d)")
"""An operator with a number (or closing parenthesis) on its left and a number on its right."""
_MATH_SYMBOLS = frozenset("0123456789+-*/×÷^=().")


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """Character spans [start, end) of the sentences of `text`, without surrounding whitespace."""
    spans, start = [], 0
    for match in _SENTENCE_BREAK.finditer(text):
        spans.append((start, match.start()))
        start = match.end()
    spans.append((start, len(text)))
    stripped = []
    for begin, end in spans:
        piece = text[begin:end]
        if piece.strip():
            left = len(piece) - len(piece.lstrip())
            stripped.append((begin + left, begin + len(piece.rstrip())))
    return stripped


def sentence_entities(text: str) -> list[tuple[tuple[int, int], list[str]]]:
    """Each sentence span with the entities it holds (see the module rule)."""
    result = []
    for begin, end in sentence_spans(text):
        sentence = text[begin:end]
        first_word = _FIRST_WORD_CHAR.search(sentence)
        opening = first_word.start() if first_word else -1
        entities = []
        for match in _ENTITY_RUN.finditer(sentence):
            words = match.group(0).split()
            if match.start() == opening:
                words = words[1:]  # the sentence's own capital, not evidence of a name
            if words:
                entities.append(" ".join(words))
        result.append(((begin, end), entities))
    return result


def entity_key(entity: str) -> int:
    """64-bit key of an entity string (counts are kept per key, so memory stays small)."""
    return int.from_bytes(hashlib.blake2b(entity.encode("utf-8"), digest_size=8).digest(), "little")


def entity_keys(text: str) -> list[int]:
    return [entity_key(entity) for _, entities in sentence_entities(text) for entity in entities]


def is_code_document(text: str, domain: str, config: BucketConfig) -> bool:
    if domain.lower() in CODE_DOMAINS:
        return True
    lines = [line for line in text.split("\n") if line.strip()]
    if len(lines) < max(1, config.code_min_lines):
        return False
    code_like = sum(1 for line in lines if CODE_LINE.search(line))
    return code_like >= config.code_min_line_fraction * len(lines)


def is_math_line(line: str, config: BucketConfig) -> bool:
    operators = ARITH_OPERATOR.findall(line)
    if len(operators) < max(1, config.math_min_operators) or all(op == "-" for op in operators):
        return False
    visible = [ch for ch in line if not ch.isspace()]
    symbols = sum(1 for ch in visible if ch in _MATH_SYMBOLS)
    return symbols >= config.math_min_symbol_fraction * len(visible)


def math_spans(text: str, config: BucketConfig) -> list[tuple[int, int]]:
    spans, start = [], 0
    for line in text.split("\n"):
        if is_math_line(line, config):
            left = len(line) - len(line.lstrip())
            spans.append((start + left, start + len(line.rstrip())))
        start += len(line) + 1
    return spans


def rare_entity_spans(text: str, rare_keys: set[int]) -> list[tuple[int, int]]:
    return [span for span, entities in sentence_entities(text) if any(entity_key(e) in rare_keys for e in entities)]


def char_to_byte_offsets(text: str) -> np.ndarray:
    """offsets[i] = UTF-8 byte position of character i (length len(text) + 1)."""
    codepoints = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    widths = 1 + (codepoints >= 0x80) + (codepoints >= 0x800) + (codepoints >= 0x10000)
    return np.concatenate([[0], np.cumsum(widths)]).astype(np.int64)


def span_mask(begins: np.ndarray, ends: np.ndarray, byte_spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for each token whose bytes overlap a span. A byte-fallback piece that only starts a
    multi-byte character has begin == end; it is treated as covering the byte at `begin`."""
    effective_end = np.maximum(ends, begins + 1)
    mask = np.zeros(len(begins), dtype=np.uint8)
    for start, stop in byte_spans:
        mask |= ((begins < stop) & (effective_end > start)).astype(np.uint8)
    return mask
