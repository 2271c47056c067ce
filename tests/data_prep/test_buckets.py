"""Tail buckets: the rules by hand, then a build whose buckets must hold exactly the planted spans."""

from __future__ import annotations

import json

import numpy as np
import pytest
import sentencepiece

from data_prep.buckets import (char_to_byte_offsets, is_code_document, is_math_line, sentence_entities,
                               sentence_spans, span_mask)
from data_prep.config import BucketConfig
from data_prep.doc_hash import document_hash, is_validation
from dp_helpers import build, read_dataset, summary

RULES = BucketConfig()


def test_sentence_spans_by_hand():
    text = "Hello there. New one!\nLine two"
    assert sentence_spans(text) == [(0, 12), (13, 21), (22, 30)]
    assert [text[a:b] for a, b in sentence_spans(text)] == ["Hello there.", "New one!", "Line two"]


def test_entities_drop_the_sentence_opening_capital():
    found = [entities for _, entities in sentence_entities("Yesterday Alice met Bob Smith in Paris. The end.")]
    assert found == [["Alice", "Bob Smith", "Paris"], []]


@pytest.mark.parametrize("line, is_math", [
    ("12 + 30 = 42", True),
    ("The total is 12 + 30 = 42 apples.", True),
    ("3*(4+5) = 27", True),
    ("In 1990-1995 the farm grew.", False),  # one operator, and only a minus
    ("2024-01-15", False),                   # a date: two minus signs only
    ("x = 1 - 2", False),                    # one operator between numbers
    ("We added 2 + 2 and got 4 = 4 in a very long sentence about many other things.", False),  # too sparse
])
def test_math_lines(line, is_math):
    assert is_math_line(line, RULES) is is_math


def test_code_detection():
    snippet = "function add(a, b) {\n  const total = a + b;\n  return total;\n}\nvar x = add(1, 2);\n"
    assert is_code_document(snippet, "", RULES)
    assert is_code_document("x", "Github", RULES)  # the domain label alone decides
    assert not is_code_document("A plain paragraph.\nAnother line of prose.\n" * 3, "Pile-CC", RULES)


def test_span_mask_and_byte_offsets_by_hand():
    assert char_to_byte_offsets("aé✓").tolist() == [0, 1, 3, 6]
    begins, ends = np.array([0, 1, 3, 5, 5]), np.array([1, 3, 5, 5, 8])
    # span bytes [3, 6): token 2 [3,5), token 3 (empty, counts as [5,6)), token 4 [5,8) overlap.
    assert span_mask(begins, ends, [(3, 6)]).tolist() == [0, 0, 1, 1, 1]


# -- end to end ---------------------------------------------------------------------------------------

SEED, VALID_FRACTION, LONG = 1234, 0.5, 200
RARE_SENTENCE = "Yesterday the envoy met Zanzibar Quellmoor at the harbour."
MATH_LINE = "The total is 12 + 30 = 42 apples."
VALID_DOCS = {
    "rare": ("", f"{RARE_SENTENCE} After lunch the team met Alice Brown again."),
    "github": ("Github", "def area(width, height):\n    return width * height\n"),
    "detected_code": ("", "function add(a, b) {\n  const total = a + b;\n  return total;\n}\nvar x = add(1, 2);"),
    "math": ("", f"Counting the apples was easy.\n{MATH_LINE}\nIn 1990-1995 the farm grew."),
    "long": ("", "the river runs past the old mill and the stones are cold. " * 40),
    "plain": ("", "a quiet day with nothing special."),
}
TRAIN_DOCS = [("", f"The letter from Alice Brown arrived on day {day}.") for day in ("one", "two", "three")] + [
    ("", "the quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire."),
    ("Github", "import os\nprint(os.getcwd())\n"),
]


def _place(text: str, want_valid: bool) -> str:
    """Append a lowercase reference line chosen so the document lands in the wanted split."""
    for ref in range(1000):
        candidate = f"{text}\nref {ref}"
        if is_validation(document_hash(candidate), VALID_FRACTION, SEED) == want_valid:
            return candidate
    raise AssertionError("no placement found")


@pytest.fixture(scope="module")
def bucket_build(tmp_path_factory):
    root = tmp_path_factory.mktemp("buckets")
    valid = {name: (domain, _place(text, True)) for name, (domain, text) in VALID_DOCS.items()}
    train = [(domain, _place(text, False)) for domain, text in TRAIN_DOCS]
    records = [{"text": t, "meta": {"pile_set_name": d}} for d, t in [*valid.values(), *train]]
    (root / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = root / "out"
    assert build(out, [root / "docs.jsonl"], "--vocab-size", "400", "--valid-fraction", str(VALID_FRACTION),
                 "--seed", str(SEED), "--long-context-tokens", str(LONG)) == 0
    sp = sentencepiece.SentencePieceProcessor(model_file=str(out / "tokenizer/tokenizer.model"))
    return out, sp, valid


def _bucket(out, name):
    return read_dataset(out / "buckets" / f"{name}_text_document"), read_dataset(out / "buckets" / f"{name}_loss_mask")


def _scored_runs(sp, tokens, mask) -> list[str]:
    runs, current = [], []
    for token, flag in zip(tokens.tolist(), mask.tolist()):
        if flag:
            current.append(token)
        elif current:
            runs.append(sp.decode(current).strip())
            current = []
    if current:
        runs.append(sp.decode(current).strip())
    return runs


def _check_whole_documents(sp, tokens_list, masks, texts):
    assert len(tokens_list) == len(masks) == len(texts)
    for tokens, mask, text in zip(tokens_list, masks, texts):
        # the bucket document is the full validation document (all preceding context) + EOD
        assert tokens.tolist() == sp.encode(text) + [sp.eos_id()]
        assert mask.shape == tokens.shape and mask[-1] == 0  # EOD is never scored


def test_rare_entity_bucket_scores_only_the_rare_sentence(bucket_build):
    out, sp, valid = bucket_build
    tokens, masks = _bucket(out, "rare_entity")
    _check_whole_documents(sp, tokens, masks, [valid["rare"][1]])
    assert _scored_runs(sp, tokens[0], masks[0]) == [RARE_SENTENCE]  # "Alice Brown" is frequent in train


def test_code_bucket_scores_whole_code_documents(bucket_build):
    out, sp, valid = bucket_build
    tokens, masks = _bucket(out, "code")
    _check_whole_documents(sp, tokens, masks, [valid["github"][1], valid["detected_code"][1]])
    for mask in masks:
        assert mask[:-1].all()


def test_math_bucket_scores_only_the_arithmetic_line(bucket_build):
    out, sp, valid = bucket_build
    tokens, masks = _bucket(out, "math")
    _check_whole_documents(sp, tokens, masks, [valid["math"][1]])
    assert _scored_runs(sp, tokens[0], masks[0]) == [MATH_LINE]


def test_long_context_bucket_scores_tokens_past_the_threshold(bucket_build):
    out, sp, valid = bucket_build
    tokens, masks = _bucket(out, "long_context")
    _check_whole_documents(sp, tokens, masks, [valid["long"][1]])
    n = len(sp.encode(valid["long"][1]))
    assert n > LONG
    assert masks[0].tolist() == [0] * LONG + [1] * (n - LONG) + [0]


def test_bucket_summary_counts(bucket_build):
    out, sp, valid = bucket_build
    counts = summary(out)["tokens"]["buckets"]
    assert {name: c["documents"] for name, c in counts.items()} == {
        "rare_entity": 1, "code": 2, "math": 1, "long_context": 1}
    n_long = len(sp.encode(valid["long"][1]))
    assert counts["long_context"]["scored_tokens"] == n_long - LONG
    assert summary(out)["documents"]["written"] == {"train": 5, "valid": 6, "total": 11}
