"""Dedup and split are functions of the inputs alone: not of reruns, worker count, or shard timing."""

from __future__ import annotations

import numpy as np
import sentencepiece

from data_prep.doc_hash import document_hash, is_validation, normalize_for_dedup
from dp_helpers import CORPUS_OPTIONS, FIXTURES, build, output_bytes, read_dataset, summary


def test_normal_form_and_hash_by_hand():
    assert normalize_for_dedup("  A\u0301b \t\n c  ") == "\u00c1b c"  # NFC joins A + combining acute
    assert document_hash("A duplicated   document\nwith spacing.") == document_hash("A duplicated document with spacing.")
    assert document_hash("Hello") != document_hash("hello")  # case is kept
    assert len(document_hash("x")) == 16


def test_split_rule_by_hand():
    # u = first 8 bytes of sha256(b"split" + seed(8 bytes, big-endian) + hash) / 2**64
    import hashlib

    doc = document_hash("some text")
    u = int.from_bytes(hashlib.sha256(b"split" + (7).to_bytes(8, "big") + doc).digest()[:8], "big") / 2**64
    assert is_validation(doc, u + 1e-12, 7) and not is_validation(doc, u, 7)
    assert not is_validation(doc, 0.0, 7) and is_validation(doc, 1.0, 7)


def test_same_input_twice_is_byte_identical(tmp_path, small_corpus, corpus_reference):
    assert build(tmp_path / "again", [small_corpus], *CORPUS_OPTIONS) == 0
    again, reference = output_bytes(tmp_path / "again"), output_bytes(corpus_reference)
    assert "train_text_document.bin" in reference and "valid_text_document.idx" in reference
    assert again == reference


def test_two_workers_match_one_worker(tmp_path, small_corpus, corpus_reference):
    assert build(tmp_path / "two", [small_corpus], *CORPUS_OPTIONS, "--workers", "2") == 0
    assert output_bytes(tmp_path / "two") == output_bytes(corpus_reference)


def test_no_document_in_both_splits(corpus_reference):
    sp = sentencepiece.SentencePieceProcessor(model_file=str(corpus_reference / "tokenizer/tokenizer.model"))

    def hashes(prefix):
        return {document_hash(sp.decode(doc[:-1].tolist())) for doc in read_dataset(corpus_reference / prefix)}

    train, valid = hashes("train_text_document"), hashes("valid_text_document")
    assert train and valid and not train & valid
    counts = summary(corpus_reference)["documents"]["written"]
    assert (len(train), len(valid)) == (counts["train"], counts["valid"])  # no duplicate inside a split either


def _decoded_documents(output):
    sp = sentencepiece.SentencePieceProcessor(model_file=str(output / "tokenizer/tokenizer.model"))
    docs = []
    for prefix in ("train_text_document", "valid_text_document"):
        if (output / f"{prefix}.bin").exists():
            docs += [sp.decode(doc[:-1].tolist()) for doc in read_dataset(output / prefix)]
    return docs


def test_first_copy_in_canonical_order_is_kept_for_any_worker_count(tmp_path):
    # a-pile line 12 and b-truncated line 3 differ only in whitespace; a-pile sorts first, so its
    # spelling must survive, with 1 or 2 workers alike (and the outputs must be identical).
    outputs = []
    for workers in ("1", "2"):
        out = tmp_path / f"w{workers}"
        assert build(out, [FIXTURES / "bad_inputs"], "--vocab-size", "320", "--valid-fraction", "0.3",
                     "--workers", workers) == 0
        outputs.append(out)
        docs = _decoded_documents(out)
        assert "A duplicated   document\nwith spacing." in docs
        assert "A duplicated document with spacing." not in docs
        assert docs.count("The first good document about rivers.") == 1
    assert output_bytes(outputs[0]) == output_bytes(outputs[1])


def test_seed_changes_the_split_but_not_the_documents(tmp_path, small_corpus, corpus_reference):
    out = tmp_path / "seed"
    assert build(out, [small_corpus], *CORPUS_OPTIONS, "--seed", "99") == 0
    reference_valid = read_dataset(corpus_reference / "valid_text_document")
    other = summary(out)["documents"]
    assert other["written"]["total"] == summary(corpus_reference)["documents"]["written"]["total"]
    assert [d.tolist() for d in read_dataset(out / "valid_text_document")] != [d.tolist() for d in reference_valid]
    assert np.isfinite(other["written"]["valid"])


def test_hash_rows_keep_trailing_nul_bytes():
    from data_prep.dedup import hash_rows

    digest = b"\x01" * 14 + b"\x00\x00"  # numpy's bytes() of an S16 element would drop the NULs
    rows = hash_rows(np.array([digest], dtype="S16"))
    assert rows[0].tobytes() == digest
