"""Tokenizer files of an export: `tokenizer.model` (our sentencepiece model, byte-identical), the
fast tokenizer `tokenizer.json` built from it, and `tokenization_triroute.py` (the slow one).

Our sentencepiece model (data_prep/tokenizer.py) is BPE with byte fallback, identity
normalisation, kept whitespace and a dummy-prefix space; training text is `encode(text)` with no
BOS/EOS and the EOS piece `</s>` appended as end of document. The fast tokenizer reproduces
that: normaliser = prepend one "▁" (always, even before a leading space) then every " " -> "▁";
no pre-tokeniser (sentencepiece merges across the whole normalised text; no piece spans a word
start); BPE with the model's merges ranked by piece score and byte fallback; decoder = "▁" -> " ",
byte fallback, fuse, strip the one dummy-prefix space. `</s>` in text is text
(`split_special_tokens`), as sentencepiece reads it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .completeness import ExportError


def build_fast_tokenizer(model_file: Path):
    from tokenizers import Tokenizer, decoders, normalizers
    from tokenizers.models import BPE
    from transformers.tokenization_utils_sentencepiece import SentencePieceExtractor

    vocab, _scores, merges = SentencePieceExtractor(str(model_file)).extract()
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1, right=0)])
    return tok


def write_tokenizer(directory: Path, model_file: Path, eod_id: int, max_length: int) -> None:
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    if sp.eos_id() != eod_id:
        raise ExportError(f"{model_file}: its EOS id {sp.eos_id()} is not the run's EOD id {eod_id}. Fix: pass the "
                          "data directory the run was trained on (--data).")
    shutil.copyfile(model_file, directory / "tokenizer.model")
    tok = build_fast_tokenizer(model_file)
    tok.save(str(directory / "tokenizer.json"))
    special = {"unk_token": sp.id_to_piece(sp.unk_id()), "eos_token": sp.id_to_piece(eod_id),
               "pad_token": sp.id_to_piece(eod_id)}
    if sp.bos_id() >= 0:
        special["bos_token"] = sp.id_to_piece(sp.bos_id())
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": False,
        "add_eos_token": False,
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,
        "padding_side": "left",
        "model_max_length": max_length,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
