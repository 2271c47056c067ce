"""Documents -> indexed datasets -> Megatron's readers give back exactly the tokenizer's ids + EOD."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import sentencepiece

from data_prep.doc_hash import document_hash, is_validation
from dp_helpers import read_dataset, read_jsonl_zst, summary


def _expected_splits(corpus_dir, valid_fraction, seed):
    """Independent re-derivation: read the shards in sorted order, keep first copies, split by hash."""
    seen, train, valid = set(), [], []
    for shard in sorted(corpus_dir.glob("*.jsonl.zst")):
        for record in read_jsonl_zst(shard):
            digest = document_hash(record["text"])
            if digest in seen:
                continue
            seen.add(digest)
            (valid if is_validation(digest, valid_fraction, seed) else train).append(record["text"])
    return train, valid


def test_datasets_hold_exactly_the_tokenizer_ids_and_eod(small_corpus, corpus_reference):
    sp = sentencepiece.SentencePieceProcessor(model_file=str(corpus_reference / "tokenizer/tokenizer.model"))
    eod = sp.eos_id()
    train_texts, valid_texts = _expected_splits(small_corpus, 0.2, 1234)
    for prefix, texts in (("train_text_document", train_texts), ("valid_text_document", valid_texts)):
        docs = read_dataset(corpus_reference / prefix)
        assert len(docs) == len(texts) > 0
        for doc, text in zip(docs, texts):
            assert doc.tolist() == sp.encode(text) + [eod]
            assert int((doc == eod).sum()) == 1  # EOD once, at the end


def test_token_dtype_fits_the_vocabulary(corpus_reference):
    from data_prep.megatron_io import open_dataset

    dataset = open_dataset(corpus_reference / "train_text_document")
    assert dataset.index.dtype == np.uint16  # vocab 400 < 65500: Megatron's own rule picks uint16
    assert summary(corpus_reference)["token_dtype"] == "uint16"


def test_gpt_dataset_reads_the_train_and_valid_prefixes(tmp_path, corpus_reference):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    sp = sentencepiece.SentencePieceProcessor(model_file=str(corpus_reference / "tokenizer/tokenizer.model"))
    tokenizer = SimpleNamespace(vocab_size=sp.vocab_size(), eod=sp.eos_id(), pad=-1, unique_identifiers={})
    config = GPTDatasetConfig(
        random_seed=1, sequence_length=64, tokenizer=tokenizer, path_to_cache=str(tmp_path / "cache"),
        blend_per_split=[([str(corpus_reference / "train_text_document")], None),
                         ([str(corpus_reference / "valid_text_document")], None), None],
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
    )
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, [8, 4, None], lambda: True, config).build()
    sample = train[0]
    assert sample["tokens"].shape == (64,) and sample["labels"].shape == (64,)
    assert int(sample["tokens"].max()) < sp.vocab_size()
    # labels are the next tokens: the stream is the concatenated documents.
    assert sample["tokens"][1:].tolist() == sample["labels"][:-1].tolist()
    assert len(valid) >= 4
