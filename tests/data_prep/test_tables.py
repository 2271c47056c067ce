"""Token tables (megatron_triroute/vocab.py) as data_prep writes them: log_prob from TRAIN counts
(add-one smoothed), the word_start rule, the loader."""

from __future__ import annotations

import math

import numpy as np
import pytest
import sentencepiece
import torch

from dp_helpers import read_dataset, summary
from megatron_triroute.vocab import load_token_tables, log_prob_table, word_start_table


def test_log_prob_by_hand():
    # counts [3, 0, 1]: total 4, V 3 -> log(4/7), log(1/7), log(2/7)
    assert np.allclose(log_prob_table(np.array([3, 0, 1])), [math.log(4 / 7), math.log(1 / 7), math.log(2 / 7)])


@pytest.fixture(scope="module")
def processor(corpus_reference):
    return sentencepiece.SentencePieceProcessor(model_file=str(corpus_reference / "tokenizer/tokenizer.model"))


def test_word_start_rule_on_real_pieces(processor):
    table = word_start_table(processor)
    piece = processor.piece_to_id
    assert table[processor.eos_id()] == 1 and table[processor.bos_id()] == 1 and table[processor.unk_id()] == 1
    assert table[piece("<0x0A>")] == 1 and table[piece("<0x09>")] == 1 and table[piece("<0x20>")] == 1
    assert table[piece("<0x41>")] == 0  # "A" as a byte piece continues whatever precedes it
    starts = [i for i in range(processor.vocab_size()) if processor.id_to_piece(i).startswith("\u2581")]
    inner = [i for i in range(processor.vocab_size()) if not processor.is_byte(i) and not processor.is_control(i)
             and not processor.is_unknown(i) and not processor.id_to_piece(i).startswith("\u2581")]
    assert starts and inner
    assert table[starts].all() and not table[inner].any()


def test_loader_returns_tensors_and_eod_matching_train_counts(corpus_reference, processor):
    log_prob, word_start, eod = load_token_tables(corpus_reference / "tokenizer/token_tables.safetensors")
    assert log_prob.dtype == torch.float32 and word_start.dtype == torch.bool
    assert log_prob.shape == word_start.shape == (processor.vocab_size(),)
    assert eod == processor.eos_id() == summary(corpus_reference)["tokenizer"]["eod_id"]
    assert torch.isfinite(log_prob).all()
    # Recount from the train dataset alone: the validation tokens must not be in the table.
    train = np.concatenate(read_dataset(corpus_reference / "train_text_document")).astype(np.int64)
    counts = np.bincount(train, minlength=processor.vocab_size())
    expected = np.log((counts + 1) / (counts.sum() + processor.vocab_size()))
    assert np.allclose(log_prob.numpy(), expected, atol=1e-6)
    valid = np.concatenate(read_dataset(corpus_reference / "valid_text_document")).astype(np.int64)
    with_valid = np.bincount(np.concatenate([train, valid]), minlength=processor.vocab_size())
    assert not np.allclose(log_prob.numpy(), np.log((with_valid + 1) / (with_valid.sum() + processor.vocab_size())))


def test_metadata_and_bad_file(corpus_reference, tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import save_file

    from data_prep.atomic import sha256_file

    path = corpus_reference / "tokenizer/token_tables.safetensors"
    with safe_open(str(path), framework="np") as handle:
        meta = handle.metadata()
    assert meta["tokenizer_sha256"] == sha256_file(corpus_reference / "tokenizer/tokenizer.model")
    assert int(meta["vocab_size"]) == 400
    save_file({"log_prob": np.zeros(3, np.float32)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match="bad.safetensors.*word_start"):
        load_token_tables(tmp_path / "bad.safetensors")
