"""Document identity: the dedup hash, the train/validation split and the tokenizer sample.

All three are functions of the document's text alone (plus the seed), never of where or when it
was read, so they come out the same for any worker count, shard completion order or resume.
"""

from __future__ import annotations

import hashlib
import re
import unicodedata

HASH_BYTES = 16
"""Bytes of sha256 kept per document: 128 bits make an accidental collision among even 10^10
documents (~10^-18) far rarer than any real duplicate."""

_WHITESPACE_RUN = re.compile(r"\s+")


def normalize_for_dedup(text: str) -> str:
    """The text two documents must share to count as duplicates.

    Rule: Unicode NFC, then every run of whitespace (spaces, tabs, newlines, Unicode spaces)
    collapsed to a single space, then leading/trailing whitespace stripped. Case and punctuation
    are kept: "Hello" and "hello" are different documents. Only the hash uses this form; the
    document is tokenized as written.
    """
    return _WHITESPACE_RUN.sub(" ", unicodedata.normalize("NFC", text)).strip()


def document_hash(text: str) -> bytes:
    """First `HASH_BYTES` bytes of sha256 over the UTF-8 of `normalize_for_dedup(text)`."""
    return hashlib.sha256(normalize_for_dedup(text).encode("utf-8")).digest()[:HASH_BYTES]


def _unit_interval(doc_hash: bytes, seed: int, purpose: bytes) -> float:
    # Re-hashing with the seed and a purpose tag makes the split and the sample independent of
    # each other and of the dedup hash's own bits.
    digest = hashlib.sha256(purpose + seed.to_bytes(8, "big") + doc_hash).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def is_validation(doc_hash: bytes, valid_fraction: float, seed: int) -> bool:
    """Document-level split: validation iff u < valid_fraction, where u in [0, 1) is the first
    8 bytes (big-endian) of sha256(b"split" + seed as 8 bytes + doc_hash) divided by 2**64.

    Duplicates share a hash, so no text can land in both splits.
    """
    return _unit_interval(doc_hash, seed, b"split") < valid_fraction


def in_tokenizer_sample(doc_hash: bytes, rate: float, seed: int) -> bool:
    """Whether a train document is in the tokenizer training sample (same rule, tag b"sample")."""
    return _unit_interval(doc_hash, seed, b"sample") < rate
