"""Tokenizer training edge cases and adopting a given model."""

from __future__ import annotations

from dp_helpers import FIXTURES, build, read_dataset, summary


def test_vocabulary_too_large_is_lowered_logged_and_recorded(tmp_path, capsys):
    assert build(tmp_path / "out", [FIXTURES / "formats"], "--vocab-size", "50000") == 0
    info = summary(tmp_path / "out")["tokenizer"]
    assert info["requested_vocab_size"] == 50000 and 260 < info["vocab_size"] < 50000
    err = capsys.readouterr().err
    assert "vocabulary size 50000 is too large" in err and f"training with {info['vocab_size']}" in err


def test_vocabulary_too_small_names_the_minimum(tmp_path, capsys):
    assert build(tmp_path / "out", [FIXTURES / "formats"], "--vocab-size", "262") == 2
    err = capsys.readouterr().err
    assert "--vocab-size 262" in err and "Fix: pass --vocab-size" in err


def test_given_tokenizer_is_used_as_is(tmp_path, corpus_reference, small_corpus):
    model = corpus_reference / "tokenizer/tokenizer.model"
    out = tmp_path / "given"
    assert build(out, [small_corpus], "--tokenizer", str(model), "--valid-fraction", "0.2",
                 "--long-context-tokens", "600") == 0
    info = summary(out)["tokenizer"]
    assert info["trained"] is False and info["sha256"] == summary(corpus_reference)["tokenizer"]["sha256"]
    assert (out / "tokenizer/tokenizer.model").read_bytes() == model.read_bytes()
    same = [d.tolist() for d in read_dataset(out / "train_text_document")]
    assert same == [d.tolist() for d in read_dataset(corpus_reference / "train_text_document")]
