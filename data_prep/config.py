"""The typed configuration of the data pipeline.

`PrepConfig` is what `build` and `merge` read; `ShardConfig` is the subset the per-shard
`shard` stage needs (so the tasks of a Slurm array can run it alone). `validate()` runs once
at start-up and raises `PrepError` naming the field, the bad value and the fix.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional


class PrepError(RuntimeError):
    """A fatal, user-fixable problem (bad option, unopenable input, nothing valid left).

    The CLI prints the message and exits non-zero; the message names the value and the fix.
    """


def _fail(name: str, value: Any, why: str, fix: str) -> None:
    raise PrepError(f"{name}={value!r}: {why}. Fix: {fix}.")


@dataclass
class ShardConfig:
    """What the per-shard parse stage needs: where the shards are and how to read them."""

    inputs: list[str] = field(default_factory=list)
    """Input paths, globs or directories. Expanded and sorted by absolute path: that sorted order
    is the canonical order every later decision (dedup, concatenation) follows."""
    output: str = ""
    """Output directory. Intermediates live under `<output>/work/`."""
    text_field: str = "text"
    """JSON key (or parquet column) holding the document text."""
    workers: int = 1
    """Worker processes; 1 runs everything in this process. Outputs do not depend on it."""

    def validate(self) -> None:
        if not self.inputs:
            _fail("inputs", self.inputs, "no input given", "pass --input PATH_OR_GLOB (repeatable)")
        if not self.output:
            _fail("output", self.output, "no output directory given", "pass --output DIR")
        if not self.text_field:
            _fail("text_field", self.text_field, "empty field name", "pass --text-field NAME (default: text)")
        if self.workers < 1:
            _fail("workers", self.workers, "must be >= 1", "pass --workers 1 or more")


@dataclass
class TokenizerConfig:
    """Train a sentencepiece BPE model on the train split, or load a given one."""

    model: Optional[str] = None
    """Path of an existing sentencepiece `.model`; when set nothing is trained."""
    vocab_size: int = 4000
    """Vocabulary size to train (the paper's recipes use ~50k; the embedded corpus is small, so 4000).
    Too large for the sample: lowered to sentencepiece's stated maximum, logged and recorded in
    summary.json. Too small to hold the byte and character pieces: a PrepError naming the minimum."""
    sample_bytes: int = 200_000_000
    """Byte budget of the tokenizer training sample, drawn deterministically (by document hash) from
    the deduplicated train split. 200 MB is plenty for a 50k BPE vocabulary."""
    threads: int = 4
    """sentencepiece trainer threads. Fixed, not tied to --workers, because sentencepiece's result
    depends on its thread count: this keeps the model identical whatever --workers is."""
    character_coverage: float = 0.9995
    """Fraction of characters given their own piece; rarer ones fall back to UTF-8 byte pieces."""

    def validate(self) -> None:
        if self.model is None and self.vocab_size < 260:
            _fail("tokenizer.vocab_size", self.vocab_size, "byte fallback alone needs 256 byte pieces "
                  "plus <unk>, <s>, </s>", "pass --vocab-size of at least a few hundred")
        if self.sample_bytes <= 0:
            _fail("tokenizer.sample_bytes", self.sample_bytes, "must be positive",
                  "pass --tokenizer-sample-bytes N")
        if self.threads < 1:
            _fail("tokenizer.threads", self.threads, "must be >= 1", "pass --tokenizer-threads 1 or more")
        if not 0.0 < self.character_coverage <= 1.0:
            _fail("tokenizer.character_coverage", self.character_coverage, "must be in (0, 1]",
                  "use 0.9995 (the sentencepiece default)")


@dataclass
class BucketConfig:
    """Thresholds of the tail buckets cut from the validation documents (rules in `buckets.py`)."""

    rare_entity_max_train_count: int = 2
    """An entity is rare when it occurs at most this many times in the deduplicated train split
    (the text the model learns from), so an entity seen only in validation counts 0."""
    code_min_lines: int = 5
    """A document without a code domain label needs at least this many non-blank lines to be
    detected as code (short snippets are too ambiguous)."""
    code_min_line_fraction: float = 0.5
    """...and at least this fraction of its non-blank lines must look like code."""
    math_min_operators: int = 2
    """A line is arithmetic-heavy with at least this many operators between numbers
    (`12 + 30 = 42` has two; a year range `1990-1995` has one and is not math)."""
    math_min_symbol_fraction: float = 0.2
    """...and when digits and arithmetic symbols make up at least this fraction of its
    non-space characters (keeps prose that merely mentions one sum out)."""
    long_context_min_tokens: int = 4096
    """Documents with more tokens than this form the long-context bucket; tokens at positions
    >= this are the scored ones (they are the ones that need the long context)."""

    def validate(self) -> None:
        for name in ("rare_entity_max_train_count", "code_min_lines", "math_min_operators"):
            if getattr(self, name) < 0:
                _fail(f"buckets.{name}", getattr(self, name), "must be >= 0", "pass a non-negative integer")
        for name in ("code_min_line_fraction", "math_min_symbol_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                _fail(f"buckets.{name}", getattr(self, name), "must be in [0, 1]", "pass a fraction")
        if self.long_context_min_tokens < 1:
            _fail("buckets.long_context_min_tokens", self.long_context_min_tokens, "must be >= 1",
                  "pass --long-context-tokens 4096 (or another positive count)")


@dataclass
class PrepConfig:
    """Everything `build` / `merge` need."""

    shard: ShardConfig = field(default_factory=ShardConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    buckets: BucketConfig = field(default_factory=BucketConfig)
    valid_fraction: float = 0.05
    """Fraction of deduplicated documents held out for validation, chosen by document hash. The
    embedded corpus is small, so 5%; the Slurm recipes for large corpora use 0.005."""
    seed: int = 1234
    """Salts the split and the tokenizer sample: another seed gives another (still deterministic) split."""

    def validate(self) -> None:
        self.shard.validate()
        self.tokenizer.validate()
        self.buckets.validate()
        if not 0.0 <= self.valid_fraction < 1.0:
            _fail("valid_fraction", self.valid_fraction, "must be in [0, 1)",
                  "pass --valid-fraction 0.005 (for example); 1.0 would leave no training data")
        if not 0 <= self.seed < 2**63:
            _fail("seed", self.seed, "must be in [0, 2**63)", "pass a non-negative integer")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
