"""The exported tokenizer (fast `tokenizer.json`, slow `tokenization_triroute.py` over
`tokenizer.model`) tokenizes exactly as our sentencepiece model, token by token."""

import pytest

TEXTS = [
    "Hello world",
    "  two leading spaces, then    a run of four",
    "\ttabs\tand\nnewlines\n\n\nthree of them\r\n",
    "digits 1234567890 3.14159 -42 0x1F 2026-11-23",
    " leading space",
    "trailing spaces   ",
    "non-ASCII: héllo naïve café Ωμέγα 日本語のテキスト 🙂🚀 ∑∫√",
    "a literal </s> and <s> and <unk> in text",
    "def main():\n    return [x ** 2 for x in range(10)]\n",
    " ",
    "",
    "\u00a0no-break\u3000ideographic space",
]


@pytest.fixture(scope="module")
def tokenizers(tiny_data, tmp_path_factory):
    import sentencepiece
    from transformers import AutoTokenizer
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    from megatron_triroute.vocab import load_token_tables
    from megatron_triroute.export.remote_code import TEMPLATES
    from megatron_triroute.export.tokenizer import write_tokenizer

    model_file = tiny_data / "tokenizer" / "tokenizer.model"
    _, _, eod = load_token_tables(tiny_data / "tokenizer" / "token_tables.safetensors")
    out = tmp_path_factory.mktemp("tok")
    write_tokenizer(out, model_file, eod, 128)
    (out / "tokenization_triroute.py").write_text((TEMPLATES / "tokenization_triroute.py").read_text())
    fast = AutoTokenizer.from_pretrained(out)
    slow_class = get_class_from_dynamic_module("tokenization_triroute.TriRouteTokenizer", str(out))
    slow = slow_class.from_pretrained(out)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    return sp, fast, slow, eod


def _corpus(tiny_data, limit=120):
    import json

    import zstandard

    docs = []
    for path in sorted((tiny_data.parent / "corpus").glob("*.jsonl.zst")):
        with open(path, "rb") as handle:
            text = zstandard.ZstdDecompressor().stream_reader(handle).read().decode()
        docs += [json.loads(line)["text"] for line in text.splitlines() if line.strip()]
    return docs[:limit]


def test_fast_and_slow_tokenize_exactly_as_sentencepiece(tokenizers, tiny_data):
    sp, fast, slow, eod = tokenizers
    texts = TEXTS + _corpus(tiny_data)
    byte_fallback = 0
    for text in texts:
        want = sp.encode(text)
        assert fast(text, add_special_tokens=False)["input_ids"] == want, repr(text)
        assert slow(text, add_special_tokens=False)["input_ids"] == want, repr(text)
        assert fast.convert_ids_to_tokens(want) == [sp.id_to_piece(i) for i in want]
        assert fast.decode(want) == sp.decode(want), repr(text)
        assert slow.decode(want) == sp.decode(want), repr(text)
        byte_fallback += sum(sp.id_to_piece(i).startswith("<0x") for i in want)
    assert byte_fallback > 0  # the non-ASCII texts exercise byte fallback


def test_end_of_document(tokenizers):
    sp, fast, slow, eod = tokenizers
    for tok in (fast, slow):
        assert tok.eos_token_id == eod == sp.eos_id() and tok.pad_token_id == eod
        assert tok("x")["input_ids"] == sp.encode("x")  # no BOS/EOS added, as in training
        doc = sp.encode("first document") + [eod] + sp.encode("second")
        assert tok.decode(doc, skip_special_tokens=True) == sp.decode(doc) == "first document second"
        assert tok.convert_ids_to_tokens(doc).count("</s>") == 1


def test_vocabulary_is_the_same(tokenizers):
    sp, fast, slow, _ = tokenizers
    want = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    assert fast.get_vocab() == want
    assert slow.get_vocab() == want
